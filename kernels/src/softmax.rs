//! Softmax and log-softmax over the last dimension, with a backward.
//!
//! `candle_nn::ops::softmax_last_dim` has no backward (it is applied with `apply_op1_no_bwd`), so
//! a model built on it silently gets no gradient through attention. Here the forward keeps only
//! its output, and the backward is `y * (g - sum(g * y))` (log-softmax: `g - exp(y) * sum(g)`).

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, D};

use crate::cpu;

struct Softmax {
    log: bool,
}

/// Softmax of one row, probabilities below `tiny` written as 0.
///
/// Why `tiny`: a probability under f32's smallest normal value (1.2e-38; a sharp attention
/// row has many) would be stored as a subnormal number in f32 or bf16, and x86 multiplies
/// subnormal operands many times slower: the products that read the probabilities (`p @ v`,
/// and in backward `dS @ k`) slow down with them (measured on the fused cross-entropy, whose
/// probabilities had the same problem: docs/benchmarks.md). What 0 drops is under
/// `1.2e-38 x |v|` per term. f64 outputs keep every value (`tiny` 0).
fn softmax_row(x: &[f64], y: &mut [f64], tiny: f64) {
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut s = 0.0;
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = (xi - m).exp();
        s += *yi;
    }
    for yi in y.iter_mut() {
        *yi /= s;
        if *yi < tiny {
            *yi = 0.0;
        }
    }
}

fn log_softmax_row(x: &[f64], y: &mut [f64]) {
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + x.iter().map(|xi| (xi - m).exp()).sum::<f64>().ln();
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = xi - lse;
    }
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        if self.log {
            "ft-log-softmax-last-dim"
        } else {
            "ft-softmax-last-dim"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let tiny = if matches!(s, CpuStorage::F64(_)) {
            0.0
        } else {
            f32::MIN_POSITIVE as f64
        };
        let soft = move |x: &[f64], y: &mut [f64]| softmax_row(x, y, tiny);
        let f: &(dyn Fn(&[f64], &mut [f64]) + Sync) =
            if self.log { &log_softmax_row } else { &soft };
        Ok((cpu::rows(s, l, f)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            crate::cuda::softmax_forward(s, l, self.log)?,
            l.shape().clone(),
        ))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if res.device().is_cuda() {
            return Ok(Some(crate::cuda::softmax_backward(res, g, self.log)?));
        }
        let grad = if self.log {
            let s = g.sum_keepdim(D::Minus1)?;
            (g - res.exp()?.broadcast_mul(&s)?)?
        } else {
            let s = (g * res)?.sum_keepdim(D::Minus1)?;
            (res * g.broadcast_sub(&s)?)?
        };
        Ok(Some(grad))
    }
}

/// Softmax over the last dimension: one kernel per pass (f64 per row on the CPU, f32 on CUDA).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if crate::has_kernel(x) {
        x.contiguous()?.apply_op1(Softmax { log: false })
    } else {
        // A composition with a correct backward on devices without a kernel.
        let m = x.max_keepdim(D::Minus1)?.detach();
        let e = x.broadcast_sub(&m)?.exp()?;
        e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
    }
}

/// Log-softmax over the last dimension.
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if crate::has_kernel(x) {
        x.contiguous()?.apply_op1(Softmax { log: true })
    } else {
        let m = x.max_keepdim(D::Minus1)?.detach();
        let z = x.broadcast_sub(&m)?;
        z.broadcast_sub(&z.exp()?.sum_keepdim(D::Minus1)?.log()?)
    }
}
