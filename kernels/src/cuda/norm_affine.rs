//! A norm with its affine part and activation as one op (`norm_affine.cu`): the forward, one
//! block per row. The backward is composed on the device (`crate::norm_affine`): the
//! normalised values again (`norm.cu`), the activation's gradient from candle's ops, the
//! parameters' sums, and the input's gradient through `norm.cu`'s backward.
//!
//! - CPU reference: `crate::norm_affine` (its CPU passes).
//! - GPU check: `tests/cuda/ops.rs` (`norm_affine_matches_the_cpu`); logic without a GPU:
//!   `tests/emulated` (`norm_affine_case`).

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, Layout, Result};

use super::launch::{dptr, launch, out_ptr, output, row_block, suffix, Arg};
use crate::activation::Activation;

/// Rows of `cols` values; the channel of column `j` of row `r` is
/// `(r % groups) * per_group + j / inner`.
pub(crate) struct NormRows {
    pub rows: usize,
    pub cols: usize,
    pub groups: usize,
    pub per_group: usize,
    pub inner: usize,
}

/// `act(norm(x) * w + b)` over `rows`, a fresh contiguous output; `w` and `b` contiguous,
/// either absent.
pub(crate) fn norm_affine_forward(
    (xs, xl): (&CudaStorage, &Layout),
    w: Option<(&CudaStorage, &Layout)>,
    b: Option<(&CudaStorage, &Layout)>,
    rows: &NormRows,
    (eps, center): (f64, bool),
    act: Option<Activation>,
) -> Result<CudaStorage> {
    let dt = xs.dtype();
    if rows.rows > u32::MAX as usize || rows.cols > i32::MAX as usize {
        candle_core::bail!(
            "norm: {} rows of {} values exceed the kernel's grid or index",
            rows.rows,
            rows.cols
        );
    }
    let out = output(&xs.device, dt, rows.rows * rows.cols)?;
    if rows.rows == 0 || rows.cols == 0 {
        return Ok(out);
    }
    let ptr = |p: Option<(&CudaStorage, &Layout)>| p.map_or(Ok(0), |(s, l)| dptr(s, l));
    launch(
        &xs.device,
        &format!("norm_affine_fwd_{}", suffix(dt)?),
        (rows.rows as u32, 1),
        row_block(rows.cols),
        &[
            Arg::Ptr(dptr(xs, xl)?),
            Arg::Ptr(ptr(w)?),
            Arg::Ptr(ptr(b)?),
            Arg::Ptr(out_ptr(&out)?),
            Arg::I32(rows.cols as i32),
            Arg::I32(rows.groups as i32),
            Arg::I32(rows.per_group as i32),
            Arg::I32(rows.inner.max(1) as i32),
            Arg::F32(eps as f32),
            Arg::I32(center as i32),
            Arg::I32(act.map_or(-1, super::gated::code)),
        ],
    )?;
    Ok(out)
}
