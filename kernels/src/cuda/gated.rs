//! The gated feed-forward `act(gate) * value` (`gated.cu`): forward and backward as grid-stride
//! element kernels over rows, for both of `crate::gated`'s forms (two tensors; the two halves of
//! one projection's rows).
//!
//! - CPU reference: `crate::gated` (its CPU passes).
//! - GPU check: `tests/cuda/ops.rs` (`gated_matches_the_cpu`); logic without a GPU:
//!   `tests/emulated` (`gated_case`).

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Layout, Result};

use super::launch::{dptr, elem_grid, launch, out_ptr, output, suffix, Arg};
use crate::activation::Activation;

/// The kernels' code of an activation (`gated.cu`).
pub(crate) fn code(act: Activation) -> i32 {
    match act {
        Activation::GeluTanh => 0,
        Activation::GeluErf => 1,
        Activation::Silu => 2,
        Activation::Relu => 3,
    }
}

/// Where the operands' rows lie: `width` values a row, rows `stride` apart, the value's and the
/// gate's first row `value_at` and `gate_at` elements into their storages.
pub(crate) struct Rows {
    pub width: usize,
    pub stride: usize,
    pub value_at: usize,
    pub gate_at: usize,
}

/// The element size of a kernel dtype.
fn size(dt: DType) -> u64 {
    dt.size_in_bytes() as u64
}

/// `act(gate) * value` over `n` elements (rows of `rows.width`), a fresh contiguous output.
pub(crate) fn gated_forward(
    (gs, gl): (&CudaStorage, &Layout),
    (vs, vl): (&CudaStorage, &Layout),
    n: usize,
    rows: &Rows,
    act: Activation,
) -> Result<CudaStorage> {
    let dt = gs.dtype();
    let out = output(&gs.device, dt, n)?;
    launch(
        &gs.device,
        &format!("gated_fwd_{}", suffix(dt)?),
        (elem_grid(n), 1),
        256,
        &[
            Arg::Ptr(dptr(gs, gl)? + rows.gate_at as u64 * size(dt)),
            Arg::Ptr(dptr(vs, vl)? + rows.value_at as u64 * size(dt)),
            Arg::Ptr(out_ptr(&out)?),
            Arg::I64(n as i64),
            Arg::I64(rows.width as i64),
            Arg::I64(rows.stride as i64),
            Arg::I32(code(act)),
        ],
    )?;
    Ok(out)
}

/// Both gradients for the output's gradient `g` (`n` elements) into one fresh buffer of
/// `out_len` elements: the gate's rows from `out.gate_at`, the value's from `out.value_at`,
/// `out.stride` apart.
pub(crate) fn gated_backward(
    (g, gl): (&CudaStorage, &Layout),
    (gs, glay): (&CudaStorage, &Layout),
    (vs, vl): (&CudaStorage, &Layout),
    (n, rows): (usize, &Rows),
    (out_len, out_rows): (usize, &Rows),
    act: Activation,
) -> Result<CudaStorage> {
    let dt = g.dtype();
    let out = output(&g.device, dt, out_len)?;
    let base = out_ptr(&out)?;
    launch(
        &g.device,
        &format!("gated_bwd_{}", suffix(dt)?),
        (elem_grid(n), 1),
        256,
        &[
            Arg::Ptr(dptr(g, gl)?),
            Arg::Ptr(dptr(gs, glay)? + rows.gate_at as u64 * size(dt)),
            Arg::Ptr(dptr(vs, vl)? + rows.value_at as u64 * size(dt)),
            Arg::Ptr(base + out_rows.gate_at as u64 * size(dt)),
            Arg::Ptr(base + out_rows.value_at as u64 * size(dt)),
            Arg::I64(n as i64),
            Arg::I64(rows.width as i64),
            Arg::I64(rows.stride as i64),
            Arg::I64(out_rows.stride as i64),
            Arg::I32(code(act)),
        ],
    )?;
    Ok(out)
}
