//! Dynamic loss scaling for f16 training.

use candle_core::{DType, Tensor};

use super::norm::all_finite;
use crate::error::Result;

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
