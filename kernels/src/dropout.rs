//! Inverted dropout whose mask is never stored: each element's keep bit is a counter-based
//! hash of (seed, its index), drawn again in backward.
//!
//! `x * mask` in candle keeps the mask (one activation-sized tensor per site) until backward,
//! and backward computes the mask's gradient too, a second activation-sized tensor that nothing
//! reads and that candle's `backward()` holds until it returns. This op keeps neither: its
//! backward multiplies the gradient by the same mask, drawn from the same hash. The values are
//! `x * mask` exactly, the mask's entries being `1 / (1 - p)` or 0 in `x`'s dtype.
//!
//! Element `i` (in row-major order) is kept when `rand_u64(seed, skip + i) >> 11`, read as a
//! uniform number in [0, 1) with 53 bits, is below `1 - p`: output `skip + i` of the splitmix64
//! stream that `ft_params::rng::SplitMix64::new(seed)` draws, so the masks are those of a
//! sequential draw from that generator, `skip` outputs on.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu;
use crate::rounding::rand_u64;

/// One dropout site's draw: what [`dropout`] applies to a tensor, and again to its gradient.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutDraw {
    /// The stream's starting state.
    pub seed: u64,
    /// The stream position of the tensor's first element.
    pub skip: u64,
    /// The probability of dropping an element, in [0, 1).
    pub p: f64,
}

impl DropoutDraw {
    /// An element is kept when its 53 random bits are below this: `u < 1 - p` for
    /// `u = bits / 2^53` is `bits < ceil((1 - p) 2^53)`, exactly, for integer bits.
    fn threshold(&self) -> u64 {
        ((1.0 - self.p) * (1u64 << 53) as f64).ceil() as u64
    }

    /// The kept elements' factor, `1 / (1 - p)` rounded to f32 (as the mask is built).
    fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.p)) as f32
    }

    /// Whether element `i` of the tensor is kept.
    pub fn keeps(&self, i: u64) -> bool {
        rand_u64(self.seed, self.skip.wrapping_add(i)) >> 11 < self.threshold()
    }

    /// The mask as a tensor of `shape` on the CPU, in f32: for devices without the kernel, and
    /// for tests.
    pub fn mask(&self, shape: &Shape) -> Result<Tensor> {
        let scale = self.scale();
        let m: Vec<f32> = (0..shape.elem_count() as u64)
            .map(|i| if self.keeps(i) { scale } else { 0.0 })
            .collect();
        Tensor::from_vec(m, shape, &candle_core::Device::Cpu)
    }
}

/// The mask's nonzero entry in `T` and `x * mask` per element, as candle multiplies in `T`.
fn apply_cpu<T: candle_core::WithDType>(d: &DropoutDraw, x: &[T]) -> Vec<T> {
    let m = T::from_f64(d.scale() as f64);
    let zero = T::zero();
    let thr = d.threshold();
    const CHUNK: usize = 1 << 14;
    let mut out = vec![zero; x.len()];
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .enumerate()
        .for_each(|(c, (o, x))| {
            let first = d.skip.wrapping_add((c * CHUNK) as u64);
            for (j, (o, &x)) in o.iter_mut().zip(x).enumerate() {
                let keep = rand_u64(d.seed, first.wrapping_add(j as u64)) >> 11 < thr;
                *o = x * if keep { m } else { zero };
            }
        });
    out
}

impl CustomOp1 for DropoutDraw {
    fn name(&self) -> &'static str {
        "ft-dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(d) => CpuStorage::F32(apply_cpu(self, cpu::slice(d, l)?)),
            CpuStorage::F64(d) => CpuStorage::F64(apply_cpu(self, cpu::slice(d, l)?)),
            CpuStorage::F16(d) => CpuStorage::F16(apply_cpu(self, cpu::slice(d, l)?)),
            CpuStorage::BF16(d) => CpuStorage::BF16(apply_cpu(self, cpu::slice(d, l)?)),
            _ => candle_core::bail!("dropout: unsupported dtype"),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::cuda::dropout_forward(
            s,
            l,
            self.seed,
            self.skip,
            self.threshold(),
            self.scale(),
        )?;
        Ok((out, l.shape().clone()))
    }

    /// The gradient times the same mask: the product's backward, without the mask's gradient.
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(dropout_with(g, *self, false)?))
    }
}

/// `x` under draw `d`: the kernel where the device has one (an op of the graph when `track`,
/// as the forward is; not, as the backward's product with the gradient is), else the product
/// with a mask built on the host.
fn dropout_with(x: &Tensor, d: DropoutDraw, track: bool) -> Result<Tensor> {
    if !crate::has_kernel(x) {
        return x * d
            .mask(x.shape())?
            .to_dtype(x.dtype())?
            .to_device(x.device())?;
    }
    let x = x.contiguous()?;
    if track {
        x.apply_op1(d)
    } else {
        x.apply_op1_no_bwd(&d)
    }
}

/// `x` with each element dropped with probability `p` and the rest scaled by `1 / (1 - p)`,
/// the keep bits drawn from `seed` starting `skip` outputs into its stream; `p = 0` returns `x`.
/// Where the device has no kernel (f64 on CUDA, other devices, `FT_CUDA_KERNELS=0`), `x` times
/// a mask built on the host: the product keeps the mask and backward computes its gradient,
/// which the memory plan does not count.
pub fn dropout(x: &Tensor, p: f64, seed: u64, skip: u64) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        candle_core::bail!("dropout: p must be in [0, 1), got {p}");
    }
    if p == 0.0 {
        return Ok(x.clone());
    }
    dropout_with(x, DropoutDraw { seed, skip, p }, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The threshold keeps exactly the draws a float comparison `u < 1 - p` keeps.
    #[test]
    fn the_integer_threshold_is_the_float_comparison() {
        for p in [0.1, 0.5, 0.25, 1.0 / 3.0, 0.999] {
            let d = DropoutDraw {
                seed: 7,
                skip: 0,
                p,
            };
            let t = d.threshold();
            for bits in [t.saturating_sub(1), t, t + 1] {
                let u = bits as f64 / (1u64 << 53) as f64;
                assert_eq!(bits < t, u < 1.0 - p, "p {p} bits {bits}");
            }
        }
    }
}
