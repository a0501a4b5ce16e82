//! Precision policy: storage dtype of the weights, fp32 master weights, dynamic loss scaling, and
//! gradient clipping by global norm.

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// Dtypes a model trains with.
///
/// `storage` is the dtype of the model's weights (and so of its activations and gradients).
/// When it is bf16 or f16 the optimizer updates fp32 master copies and writes them back rounded:
/// a bf16 weight has 8 bits of mantissa, so updates smaller than 1/256 of the weight would
/// vanish (measured: pure-bf16 AdamW at lr 1e-5 changed only 14.9% of the weights). The
/// exception is [`Precision::full_bf16`]: no masters, and stochastic rounding instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    /// Dtype of the stored weights (and of their gradients).
    pub storage: DType,
    /// Dtype activations are computed in: the storage dtype, or f32 where a backend lacks a
    /// low-precision kernel (candle's CPU conv2d has no bf16).
    pub compute: DType,
    pub master_weights: bool,
    pub loss_scaling: bool,
    /// bf16 weights without fp32 masters are written with stochastic rounding (kohya's
    /// `--full_bf16`): an update below half a bf16 step then survives on average instead of
    /// never.
    pub stochastic_rounding: bool,
}

impl Precision {
    /// The usual policy for a storage dtype: f32 trains as is; bf16 gets fp32 master weights;
    /// f16 also gets dynamic loss scaling (its range ends at 65,504).
    pub fn for_dtype(storage: DType) -> Self {
        Precision {
            storage,
            compute: storage,
            master_weights: matches!(storage, DType::BF16 | DType::F16),
            loss_scaling: storage == DType::F16,
            stochastic_rounding: false,
        }
    }

    /// bf16 weights updated in place, no fp32 master copies (4 bytes per parameter less), every
    /// updated weight rounded stochastically (`--full-bf16`).
    pub fn full_bf16() -> Self {
        Precision {
            master_weights: false,
            stochastic_rounding: true,
            ..Self::for_dtype(DType::BF16)
        }
    }

    /// The same policy computing in `compute` (weights are cast on use).
    pub fn with_compute(mut self, compute: DType) -> Self {
        self.compute = compute;
        self
    }

    /// Parses `f32`, `bf16`, `f16` (also `fp32`, `fp16`, `float32`, `bfloat16`, `float16`).
    pub fn parse(s: &str) -> Result<Self> {
        let dt = match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "no" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "fp16" | "float16" => DType::F16,
            other => {
                return Err(Error::Invalid(format!(
                    "unknown precision `{other}` (expected f32, bf16 or f16)"
                )))
            }
        };
        Ok(Self::for_dtype(dt))
    }
}

/// Dynamic loss scaling for f16 (the rules of `torch.cuda.amp.GradScaler`): multiply the loss by
/// `scale` before backward; if any gradient is inf/NaN skip the step and multiply the scale by
/// `backoff`; after `growth_interval` clean steps in a row multiply it by `growth`.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    pub scale: f64,
    pub growth: f64,
    pub backoff: f64,
    pub growth_interval: u64,
    good_steps: u64,
}

impl Default for LossScaler {
    fn default() -> Self {
        Self::new(65536.0)
    }
}

impl LossScaler {
    pub fn new(init_scale: f64) -> Self {
        LossScaler {
            scale: init_scale,
            growth: 2.0,
            backoff: 0.5,
            growth_interval: 2000,
            good_steps: 0,
        }
    }

    /// Divides every gradient by the scale (in fp32) and reports whether any was inf/NaN.
    /// On CUDA one kernel per gradient does the cast, the division and the check, with a single
    /// read-back for all of them.
    pub fn unscale(&self, grads: &mut [Option<Tensor>]) -> Result<bool> {
        let inv = 1.0 / self.scale;
        #[cfg(feature = "cuda")]
        if ft_kernels::cuda::enabled()
            && grads.iter().flatten().all(|g| {
                g.device().is_cuda() && matches!(g.dtype(), DType::F32 | DType::BF16 | DType::F16)
            })
            && grads.iter().flatten().next().is_some()
        {
            return Ok(ft_kernels::cuda::unscale_check(grads, inv)?);
        }
        let mut found_inf = false;
        for g in grads.iter_mut().flatten() {
            let u = (g.to_dtype(DType::F32)? * inv)?;
            if !all_finite(&u)? {
                found_inf = true;
            }
            *g = u;
        }
        Ok(found_inf)
    }

    /// Adjusts the scale after a step: back off on overflow, grow after a clean interval.
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= self.backoff;
            self.good_steps = 0;
        } else {
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale *= self.growth;
                self.good_steps = 0;
            }
        }
    }
}

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
        if let Some(s) = crate::host::sum_squares(g) {
            sq += s;
            continue;
        }
        // A bf16/f16 host gradient (one micro-batch kept in its dtype) or a strided one, widened
        // one tensor at a time: the same values, so the same norm, as its fp32 sum gives.
        if g.device().is_cpu() {
            let w = g.to_dtype(DType::F32)?.contiguous()?;
            if let Some(s) = crate::host::sum_squares(&w) {
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
            *g = match crate::host::scaled(&g32, coef) {
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
