//! Softmax and log-softmax over the last dimension (`softmax.cu`): one block per row, forward
//! and backward.
//!
//! - CPU reference: `crate::softmax` (`Softmax::cpu_fwd`, in f64 per row).
//! - GPU check: `tests/cuda/ops.rs` (`every_op_matches_its_cpu_reference`); logic without a
//!   GPU: `tests/emulated` (`softmax_case`).
//! - Timing: `cargo run --release --features cuda -p ft-kernels --example time_softmax`.

use candle_core::{CudaStorage, Layout, Result, Tensor};

use super::launch::{dptr, into_tensor, row_kernel, tensor_ptr, with_storage, Arg};

/// Softmax (or log-softmax) over the last dimension.
pub(crate) fn softmax_forward(s: &CudaStorage, l: &Layout, log: bool) -> Result<CudaStorage> {
    row_kernel("softmax_fwd", s, l, &[dptr(s, l)?], &[Arg::I32(log as i32)])
}

/// The input gradient of [`softmax_forward`] from its output `y` and the output gradient `g`.
pub fn softmax_backward(y: &Tensor, g: &Tensor, log: bool) -> Result<Tensor> {
    let y = y.contiguous()?;
    let g = g.to_dtype(y.dtype())?.contiguous()?;
    let out = with_storage(&y, |s, l| {
        row_kernel(
            "softmax_bwd",
            s,
            l,
            &[dptr(s, l)?, tensor_ptr(&g)?],
            &[Arg::I32(log as i32)],
        )
    })?;
    Ok(into_tensor(out, y.shape()))
}
