//! Precision policy: the storage dtype of the weights, fp32 master weights or stochastic
//! rounding, and whether the loss is scaled (f16).

use candle_core::DType;

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
