//! Layer and RMS normalisation over the last dimension (`norm.cu`; group norm runs it over
//! reshaped rows): one block per row, forward and backward (the row statistics recomputed).
//!
//! - CPU reference: `crate::norm` (`Normalize::cpu_fwd`, in f64 per row).
//! - GPU check: `tests/cuda/ops.rs` (`every_op_matches_its_cpu_reference`); logic without a
//!   GPU: `tests/emulated` (`norm_case`).
//! - Timing: `cargo run --release --features cuda -p ft-kernels --example time_norm`.

use candle_core::{CudaStorage, Layout, Result, Tensor};

use super::launch::{dptr, into_tensor, row_kernel, tensor_ptr, with_storage, Arg};

/// `(x - mean) * rsqrt(var + eps)` per row, or `x * rsqrt(mean(x^2) + eps)` without centring.
pub(crate) fn norm_forward(
    s: &CudaStorage,
    l: &Layout,
    eps: f64,
    center: bool,
) -> Result<CudaStorage> {
    row_kernel(
        "norm_fwd",
        s,
        l,
        &[dptr(s, l)?],
        &[Arg::F32(eps as f32), Arg::I32(center as i32)],
    )
}

/// The input gradient of [`norm_forward`], recomputing the row statistics from `x`.
pub fn norm_backward(x: &Tensor, g: &Tensor, eps: f64, center: bool) -> Result<Tensor> {
    let x = x.contiguous()?;
    let g = g.to_dtype(x.dtype())?.contiguous()?;
    let out = with_storage(&x, |s, l| {
        row_kernel(
            "norm_bwd",
            s,
            l,
            &[dptr(s, l)?, tensor_ptr(&g)?],
            &[Arg::F32(eps as f32), Arg::I32(center as i32)],
        )
    })?;
    Ok(into_tensor(out, x.shape()))
}
