//! Dropout whose mask is a pure function of a seed, so that a checkpointed segment recomputed in
//! backward draws exactly the mask its first forward drew, and a resumed run draws the masks an
//! uninterrupted run would have.

use candle_core::{DType, Tensor};
use ft_params::rng::{hash_str, SplitMix64};

/// Per-forward dropout state: `None` in evaluation, `Some(seed)` in training.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutCtx {
    pub p: f64,
    pub seed: Option<u64>,
}

impl DropoutCtx {
    /// No dropout (evaluation, or a rate of 0).
    pub fn eval() -> Self {
        DropoutCtx { p: 0.0, seed: None }
    }

    /// Training with rate `p`, masks drawn from `seed` (one seed per micro-batch).
    pub fn train(p: f64, seed: u64) -> Self {
        DropoutCtx {
            p,
            seed: Some(seed),
        }
    }

    /// Inverted dropout at the call site named `site` (a stable, unique name such as
    /// `encoder.block.3.attn`): zero with probability p, scale the rest by 1/(1-p).
    pub fn apply(&self, x: &Tensor, site: &str) -> candle_core::Result<Tensor> {
        let Some(seed) = self.seed else {
            return Ok(x.clone());
        };
        if self.p <= 0.0 {
            return Ok(x.clone());
        }
        let mut rng = SplitMix64::new(seed ^ hash_str(site));
        let keep = 1.0 - self.p;
        let scale = (1.0 / keep) as f32;
        let mask: Vec<f32> = (0..x.elem_count())
            .map(|_| if rng.uniform() < keep { scale } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(mask, x.shape(), x.device())?;
        let mask = if x.dtype() == DType::F32 {
            mask
        } else {
            mask.to_dtype(x.dtype())?
        };
        x * mask
    }
}
