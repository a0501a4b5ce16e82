//! Nearest-neighbour upsampling by 2 whose backward accumulates.
//!
//! candle's `upsample_nearest2d` backward overwrites the input's gradient instead of adding to
//! it, so an input that also feeds another op (a UNet skip connection) loses a term. Here the op
//! returns a fresh gradient (each input pixel sums its 2x2 block) and candle's autograd adds it
//! to whatever else flows into the input. One kernel per pass on CUDA; on other devices a
//! broadcast and a reshape, whose backwards candle gets right.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use crate::cpu;

struct Upsample2x;

fn upsample_plane<T: Copy>(x: &[T], h: usize, w: usize, out: &mut [T]) {
    for (oy, row) in out.chunks_mut(2 * w).enumerate() {
        let src = &x[(oy / 2) * w..(oy / 2 + 1) * w];
        for (ox, o) in row.iter_mut().enumerate() {
            *o = src[ox / 2];
        }
    }
    debug_assert_eq!(out.len(), 4 * h * w);
}

impl CustomOp1 for Upsample2x {
    fn name(&self) -> &'static str {
        "ft-upsample-nearest2x"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = match l.dims() {
            [n, c, h, w] => (*n, *c, *h, *w),
            d => candle_core::bail!("upsample expects [N, C, H, W], got {d:?}"),
        };
        fn run<T: candle_core::WithDType>(
            d: &[T],
            l: &Layout,
            h: usize,
            w: usize,
        ) -> Result<Vec<T>> {
            let x = cpu::slice(d, l)?;
            let mut out = vec![T::zero(); x.len() * 4];
            for (p, o) in out.chunks_mut(4 * h * w).enumerate() {
                upsample_plane(&x[p * h * w..(p + 1) * h * w], h, w, o);
            }
            Ok(out)
        }
        let out = match s {
            CpuStorage::F32(d) => CpuStorage::F32(run(d, l, h, w)?),
            CpuStorage::F64(d) => CpuStorage::F64(run(d, l, h, w)?),
            CpuStorage::F16(d) => CpuStorage::F16(run(d, l, h, w)?),
            CpuStorage::BF16(d) => CpuStorage::BF16(run(d, l, h, w)?),
            _ => candle_core::bail!("upsample: unsupported dtype"),
        };
        Ok((out, Shape::from((n, c, 2 * h, 2 * w))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, c, h, w) = match l.dims() {
            [n, c, h, w] => (*n, *c, *h, *w),
            d => candle_core::bail!("upsample expects [N, C, H, W], got {d:?}"),
        };
        Ok((
            crate::cuda::upsample2x_forward(s, l)?,
            Shape::from((n, c, 2 * h, 2 * w)),
        ))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if arg.device().is_cuda() {
            return Ok(Some(crate::cuda::upsample2x_backward(g, arg.dims())?));
        }
        let (n, c, h, w) = arg.dims4()?;
        Ok(Some(g.reshape((n, c, h, 2, w, 2))?.sum(5)?.sum(3)?))
    }
}

/// [N, C, H, W] -> [N, C, 2H, 2W], each pixel repeated in a 2x2 block.
pub fn upsample_nearest2x(x: &Tensor) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    if crate::has_kernel(x) {
        x.contiguous()?.apply_op1(Upsample2x)
    } else {
        x.reshape((n, c, h, 1, w, 1))?
            .broadcast_as((n, c, h, 2, w, 2))?
            .reshape((n, c, 2 * h, 2 * w))
    }
}
