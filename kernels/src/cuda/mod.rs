//! The CUDA side of the op layer, one op family per pair of files: its kernels (`softmax.cu`)
//! beside its launcher (`softmax.rs`), whose header names the family's CPU reference, its GPU
//! check and its timing example. The kernel files share `prelude.cuh` and compile as one NVRTC
//! program at run time (`nvrtc`); `launch` puts them on candle's stream with raw device pointers
//! into contiguous tensors.
//!
//! Everything runs on the one stream candle gives each device, so a kernel is ordered after the
//! work that produced its inputs and before any free of them (candle frees stream-ordered), with
//! no extra synchronisation.
//!
//! | family | kernels | used by |
//! |---|---|---|
//! | `softmax` | softmax / log-softmax over rows | `crate::softmax` |
//! | `norm` | layer and RMS norm over rows | `crate::norm` |
//! | `upsample` | nearest 2x | `crate::upsample` |
//! | `pool` | max and average pooling | `crate::pool` |
//! | `attention` | memory-efficient attention, CUDA cores and tensor cores | `crate::attention` |
//! | `adamw` | AdamW, 8-bit AdamW | ft-trainer's optimizers |
//! | `adafactor` | Adafactor | ft-trainer's optimizers |
//! | `grad_norm` | gradient sums of squares, f16 unscale | ft-trainer's update step |
//! | `rounding` | fp32 -> bf16 stochastic rounding | `crate::rounding` |
//! | `dropout` | inverted dropout, mask drawn from a hash | `crate::dropout` |
//! | `gated` | `act(gate) * value`, forward and backward | `crate::gated` |
//! | `norm_affine` | a norm with its weight, bias and activation, forward and backward | `crate::norm_affine` |

mod adafactor;
mod adamw;
mod attention;
mod dropout;
mod gated;
mod grad_norm;
mod launch;
mod norm;
mod norm_affine;
mod nvrtc;
mod pool;
mod rounding;
mod softmax;
mod upsample;

pub mod check;

use std::sync::OnceLock;

pub use adafactor::{adafactor_fused, adafactor_fused_in_place, AdafactorStep, SecondMoment};
pub use adamw::{
    adamw8bit_fused, adamw8bit_fused_in_place, adamw_fused, adamw_fused_in_place, AdamWStep,
    Moments8bit,
};
pub use attention::{fused_attention, fused_attention_supported};
pub(crate) use dropout::dropout_forward;
pub(crate) use gated::{gated_backward, gated_forward, Rows};
pub use grad_norm::{sum_squares, sum_squares_each, unscale_check};
pub use launch::{launches, launches_of};
pub use norm::norm_backward;
pub(crate) use norm::norm_forward;
pub(crate) use norm_affine::{norm_affine_backward, norm_affine_forward, NormRows};
pub(crate) use nvrtc::has_mma;
pub use nvrtc::{kernel_arch, ptx, SOURCES};
pub(crate) use pool::pool_forward;
pub use pool::{pool_backward, PoolSpec};
pub use rounding::round_stochastic_bf16;
pub use softmax::softmax_backward;
pub(crate) use softmax::softmax_forward;
pub use upsample::upsample2x_backward;
pub(crate) use upsample::upsample2x_forward;

/// Whether the own kernels are used on CUDA: yes unless `FT_CUDA_KERNELS` is `0`, `off` or
/// `false`, which falls back to compositions of candle ops (same results, more memory traffic):
/// an escape hatch, and the baseline `scripts/gpu-bench.sh` measures the kernels against.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("FT_CUDA_KERNELS")
                .unwrap_or_default()
                .to_ascii_lowercase()
                .as_str(),
            "0" | "off" | "false"
        )
    })
}

/// Whether bf16 attention uses the tensor-core forward on GPUs that have `mma.sync` (compute
/// capability 8.0 and later): yes unless `FT_ATTENTION_TC` is `0`, `off` or `false`.
pub fn tensor_cores_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("FT_ATTENTION_TC")
                .unwrap_or_default()
                .to_ascii_lowercase()
                .as_str(),
            "0" | "off" | "false"
        )
    })
}
