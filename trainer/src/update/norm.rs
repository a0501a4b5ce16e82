//! Gradient norms and clipping: the global L2 norm (also f16's overflow check), per-tensor norms
//! read back together, and `clip_grad_norm_`'s factor.

use candle_core::{DType, Tensor};

use crate::error::Result;

/// True when no element is inf or NaN (both propagate into the sum).
pub fn all_finite(t: &Tensor) -> Result<bool> {
    let s = t.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
    Ok(s.is_finite())
}

/// Global L2 norm of all gradients, computed in fp32 per tensor and summed in f64.
pub fn global_norm(grads: &[Option<Tensor>]) -> Result<f64> {
    Ok(sum_of_squares(grads)?.sqrt())
}

/// The sum of the squares of every element of every gradient, in f64: not finite when some
/// element is inf or NaN, and for f16/bf16 gradients (and fp32 ones below about 1e19, as the
/// CUDA kernel and the fallback square in f32) only then, which makes it the loss scaler's
/// overflow check and the clipping norm in one read-only pass.
pub fn sum_of_squares(grads: &[Option<Tensor>]) -> Result<f64> {
    // On CUDA: one kernel per gradient and a single read-back for all of them.
    #[cfg(feature = "cuda")]
    if ft_kernels::cuda::enabled()
        && grads.iter().flatten().next().is_some()
        && grads.iter().flatten().all(|g| {
            g.device().is_cuda() && matches!(g.dtype(), DType::F32 | DType::BF16 | DType::F16)
        })
    {
        return Ok(ft_kernels::cuda::sum_squares(grads)?);
    }
    let mut sq = 0f64;
    for g in grads.iter().flatten() {
        if let Some(s) = ft_kernels::host::sum_squares(g) {
            sq += s;
            continue;
        }
        // A bf16/f16 host gradient (one micro-batch kept in its dtype) or a strided one, widened
        // one tensor at a time: the same values, so the same norm, as its fp32 sum gives.
        if g.device().is_cpu() {
            let w = g.to_dtype(DType::F32)?.contiguous()?;
            if let Some(s) = ft_kernels::host::sum_squares(&w) {
                sq += s;
                continue;
            }
        }
        sq += g
            .to_dtype(DType::F32)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f32>()? as f64;
    }
    Ok(sq)
}

/// [`sum_of_squares`] of each tensor apart: on CUDA one kernel per tensor and one read-back for
/// all of them (the per-tensor clipping of a fused backward pass, a checkpointed segment's
/// gradients at a time), on the host the same sums one by one.
pub fn sum_of_squares_each(grads: &[Tensor]) -> Result<Vec<f64>> {
    #[cfg(feature = "cuda")]
    if ft_kernels::cuda::enabled()
        && grads.iter().all(|g| {
            g.device().is_cuda() && matches!(g.dtype(), DType::F32 | DType::BF16 | DType::F16)
        })
    {
        return Ok(ft_kernels::cuda::sum_squares_each(grads)?);
    }
    grads
        .iter()
        .map(|g| sum_of_squares(&[Some(g.clone())]))
        .collect()
}

/// Scales gradients so their global norm is at most `max_norm` (`torch.nn.utils.clip_grad_norm_`:
/// coefficient `max_norm / (norm + 1e-6)`, applied only when below 1). Returns the norm before
/// clipping.
pub fn clip_grad_norm(grads: &mut [Option<Tensor>], max_norm: f64) -> Result<f64> {
    let (norm, coef) = clip_coefficient(grads, max_norm)?;
    if coef < 1.0 {
        for g in grads.iter_mut().flatten() {
            // In fp32 whatever the gradient's dtype (a bf16 one scaled in bf16 would round).
            let g32 = g.to_dtype(DType::F32)?;
            *g = match ft_kernels::host::scaled(&g32, coef) {
                Some(t) => t?,
                None => (g32 * coef)?,
            };
        }
    }
    Ok(norm)
}

/// The global norm of `grads` and the factor `clip_grad_norm` would scale them by (1 when the
/// norm is within `max_norm`), without scaling anything: the optimizers apply the factor as
/// they read each gradient (`Optimizer::update`), which saves a pass writing a scaled copy
/// of every gradient, and an fp32 copy of each bf16 one.
pub fn clip_coefficient(grads: &[Option<Tensor>], max_norm: f64) -> Result<(f64, f64)> {
    let norm = global_norm(grads)?;
    Ok((norm, clip_factor(norm, max_norm)))
}

/// `clip_grad_norm_`'s factor for a global norm `norm`: `max_norm / (norm + 1e-6)` when that is
/// below 1, else 1.
pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        coef
    } else {
        1.0
    }
}

/// The name of the first of `tensors` that holds inf or NaN, if any: one read-only pass over all
/// of them (one read-back on CUDA), then, only when something is not finite, one tensor at a
/// time to name it.
pub fn first_non_finite<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
) -> Result<Option<&'a str>> {
    let tensors: Vec<(&str, &Tensor)> = tensors.into_iter().collect();
    let all: Vec<Option<Tensor>> = tensors.iter().map(|(_, t)| Some((*t).clone())).collect();
    if sum_of_squares(&all)?.is_finite() {
        return Ok(None);
    }
    for (name, t) in tensors {
        if !sum_of_squares(&[Some(t.clone())])?.is_finite() {
            return Ok(Some(name));
        }
    }
    Ok(None)
}
