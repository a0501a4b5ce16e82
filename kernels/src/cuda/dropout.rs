//! Inverted dropout (`dropout.cu`): keep bits from the counter-based hash of `crate::rounding`,
//! so the GPU draws the CPU's mask for a seed, and backward draws it again: grid-stride loop.
//!
//! - CPU reference: `crate::dropout` (`DropoutDraw::cpu_fwd`).
//! - GPU check: `tests/cuda/ops.rs` (`dropout_matches_the_cpu`); logic without a GPU:
//!   `tests/emulated` (`dropout_case`).

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Layout, Result};

use super::launch::{dptr, elem_grid, launch, out_ptr, output, suffix, Arg};

/// `x` times the mask of (`seed`, `skip`): kept where the element's 53 random bits are below
/// `threshold`, scaled by `scale` rounded to `x`'s dtype (as the mask's entries are).
pub(crate) fn dropout_forward(
    s: &CudaStorage,
    l: &Layout,
    seed: u64,
    skip: u64,
    threshold: u64,
    scale: f32,
) -> Result<CudaStorage> {
    let scale = match s.dtype() {
        DType::BF16 => half::bf16::from_f32(scale).to_f32(),
        DType::F16 => half::f16::from_f32(scale).to_f32(),
        _ => scale,
    };
    let n = l.shape().elem_count();
    let out = output(&s.device, s.dtype(), n)?;
    launch(
        &s.device,
        &format!("dropout_{}", suffix(s.dtype())?),
        (elem_grid(n), 1),
        256,
        &[
            Arg::Ptr(dptr(s, l)?),
            Arg::Ptr(out_ptr(&out)?),
            Arg::I64(n as i64),
            Arg::U64(seed),
            Arg::U64(skip),
            Arg::U64(threshold),
            Arg::F32(scale),
        ],
    )?;
    Ok(out)
}
