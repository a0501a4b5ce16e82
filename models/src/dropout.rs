//! Dropout whose mask is a pure function of a seed, so that a checkpointed segment recomputed in
//! backward draws exactly the mask its first forward drew, and a resumed run draws the masks an
//! uninterrupted run would have. The mask of a sample depends on its position in the
//! micro-batch the seed was drawn for, not on the batch it is computed in: a micro-batch split
//! in two (the loop's out-of-memory retry) draws the masks of the whole.

use candle_core::Tensor;
use ft_params::rng::hash_str;

/// Per-forward dropout state: `None` in evaluation, `Some(seed)` in training.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutCtx {
    pub p: f64,
    pub seed: Option<u64>,
    /// Position of this batch's first sample in the micro-batch `seed` was drawn for.
    pub first_sample: usize,
}

impl DropoutCtx {
    /// No dropout (evaluation, or a rate of 0).
    pub fn eval() -> Self {
        DropoutCtx {
            p: 0.0,
            seed: None,
            first_sample: 0,
        }
    }

    /// Training with rate `p`, masks drawn from `seed` (one seed per micro-batch).
    pub fn train(p: f64, seed: u64) -> Self {
        DropoutCtx {
            p,
            seed: Some(seed),
            first_sample: 0,
        }
    }

    /// The same masks for a part of the micro-batch that starts at its sample `first`.
    pub fn from_sample(self, first: usize) -> Self {
        DropoutCtx {
            first_sample: first,
            ..self
        }
    }

    /// Inverted dropout at the call site named `site` (a stable, unique name such as
    /// `encoder.block.3.attn`): zero with probability p, scale the rest by 1/(1-p). The mask
    /// is drawn from `SplitMix64::new(seed ^ hash_str(site))` and not stored
    /// ([`ft_kernels::dropout`]): backward draws it again, so a site holds no mask and its
    /// backward computes no gradient for one.
    pub fn apply(&self, x: &Tensor, site: &str) -> candle_core::Result<Tensor> {
        let Some(seed) = self.seed else {
            return Ok(x.clone());
        };
        if self.p <= 0.0 {
            return Ok(x.clone());
        }
        // Dim 0 is the batch (every site is batch-major): the stream is skipped to the first
        // sample's elements, as if the samples before it were in the tensor.
        let per_sample = x.elem_count() / x.dim(0)?.max(1);
        let skip = (self.first_sample * per_sample) as u64;
        ft_kernels::dropout::dropout(x, self.p, seed ^ hash_str(site), skip)
    }
}

#[cfg(test)]
mod tests {
    use super::DropoutCtx;
    use candle_core::{Device, Tensor};

    /// The masks of a micro-batch split in two are the whole's, row for row.
    #[test]
    fn a_split_batch_draws_the_masks_of_the_whole() -> candle_core::Result<()> {
        let x = Tensor::ones((6, 5, 4), candle_core::DType::F32, &Device::Cpu)?;
        let d = DropoutCtx::train(0.5, 42);
        let whole = d.apply(&x, "site")?;
        let head = d.apply(&x.narrow(0, 0, 2)?, "site")?;
        let tail = d.from_sample(2).apply(&x.narrow(0, 2, 4)?, "site")?;
        let parts = Tensor::cat(&[head, tail], 0)?;
        let diff = (whole.clone() - parts)?
            .abs()?
            .sum_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        // Not one mask for every row: the tail's rows would repeat the head's.
        let rows = whole.to_vec3::<f32>()?;
        assert_ne!(rows[0], rows[2]);
        Ok(())
    }

    /// A site's mask is the generator's sequential draw from `seed ^ hash_str(site)`, as it was
    /// when the mask was built on the host and multiplied: the same masks as runs before.
    #[test]
    fn the_mask_is_the_generators_sequential_draw() -> candle_core::Result<()> {
        use ft_params::rng::{hash_str, SplitMix64};
        let x = Tensor::ones((4, 3, 5), candle_core::DType::F32, &Device::Cpu)?;
        let d = DropoutCtx::train(0.3, 7).from_sample(2);
        let got = d
            .apply(&x, "encoder.block.0.ff")?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut rng = SplitMix64::new(7 ^ hash_str("encoder.block.0.ff"));
        rng.skip(2 * 15);
        let want: Vec<f32> = (0..60)
            .map(|_| {
                if rng.uniform() < 0.7 {
                    (1.0 / 0.7) as f32
                } else {
                    0.0
                }
            })
            .collect();
        assert_eq!(got, want);
        // And it keeps no mask: backward's gradient store holds the input's gradient alone
        // (`x * mask` adds the mask's).
        let v = candle_core::Var::from_tensor(&x)?;
        let grads = d
            .apply(v.as_tensor(), "encoder.block.0.ff")?
            .sum_all()?
            .backward()?;
        assert_eq!(grads.get_ids().count(), 1);
        Ok(())
    }
}
