//! A norm with its affine part and activation as one op (`norm_affine.cu`): the forward, one
//! block per row; the backward in two kernels, the input's gradient a row a block (keeping the
//! rows' statistics), then the weight's and bias's a channel a block, in a fixed order. The
//! backward holds the input's gradient, two floats a row and the parameters' f32 sums.
//!
//! - CPU reference: `crate::norm_affine` (its CPU passes).
//! - GPU check: `tests/cuda/ops.rs` (`norm_affine_matches_the_cpu`); logic without a GPU:
//!   `tests/emulated` (`norm_affine_case`).
//! - Timing: `cargo run --release --features cuda -p ft-kernels --example time_norm_affine`.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, DType, Layout, Result, Tensor};

use super::launch::{
    device_of, dptr, into_tensor, launch, out_ptr, output, row_block, suffix, tensor_ptr, Arg,
};
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

impl NormRows {
    fn check(&self) -> Result<()> {
        let big = |n: usize| n > i32::MAX as usize;
        if big(self.rows) || big(self.cols) || big(self.groups * self.per_group) {
            candle_core::bail!(
                "norm: {} rows of {} values ({} channels) exceed the kernels' grid or index",
                self.rows,
                self.cols,
                self.groups * self.per_group
            );
        }
        Ok(())
    }

    /// The geometry's arguments, as the kernels take them after their pointers.
    fn args(&self) -> [Arg; 4] {
        [
            Arg::I32(self.cols as i32),
            Arg::I32(self.groups as i32),
            Arg::I32(self.per_group as i32),
            Arg::I32(self.inner.max(1) as i32),
        ]
    }
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
    rows.check()?;
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
        ]
        .into_iter()
        .chain(rows.args())
        .chain([
            Arg::F32(eps as f32),
            Arg::I32(center as i32),
            Arg::I32(act.map_or(-1, super::gated::code)),
        ])
        .collect::<Vec<_>>(),
    )?;
    Ok(out)
}

/// The gradients of the input, the weight and (with `b`) the bias for the output's gradient
/// `g`: contiguous tensors on one device, `x` and `g` of `rows`' shape, `w` and `b` of its
/// channels, all of one dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_affine_backward(
    x: &Tensor,
    g: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    rows: &NormRows,
    (eps, center): (f64, bool),
    act: Option<Activation>,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    rows.check()?;
    let (dev, dt) = (device_of(x)?, x.dtype());
    let channels = rows.groups * rows.per_group;
    // The kernels read every operand at these sizes: a mismatch would read out of bounds.
    let params_fit = w.elem_count() == channels && b.is_none_or(|b| b.elem_count() == channels);
    if g.dims() != x.dims() || x.elem_count() != rows.rows * rows.cols || !params_fit {
        candle_core::bail!(
            "norm backward: gradient {:?} for input {:?}, weight {:?} for {channels} channels",
            g.dims(),
            x.dims(),
            w.dims()
        );
    }
    let dx = output(&dev, dt, rows.rows * rows.cols)?;
    let stats = output(&dev, DType::F32, 2 * rows.rows)?;
    let dw = output(&dev, DType::F32, channels)?;
    let db = b.map(|_| output(&dev, DType::F32, channels)).transpose()?;
    let ptrs = [
        tensor_ptr(x)?,
        tensor_ptr(g)?,
        tensor_ptr(w)?,
        b.map_or(Ok(0), tensor_ptr)?,
    ];
    let act = Arg::I32(act.map_or(-1, super::gated::code));
    if rows.rows > 0 && rows.cols > 0 {
        let mut args: Vec<Arg> = ptrs.iter().map(|p| Arg::Ptr(*p)).collect();
        args.extend([Arg::Ptr(out_ptr(&dx)?), Arg::Ptr(out_ptr(&stats)?)]);
        args.extend(rows.args());
        args.extend([Arg::F32(eps as f32), Arg::I32(center as i32), act]);
        let name = format!("norm_affine_bwd_x_{}", suffix(dt)?);
        launch(
            &dev,
            &name,
            (rows.rows as u32, 1),
            row_block(rows.cols),
            &args,
        )?;
    }
    if channels > 0 {
        let mut args: Vec<Arg> = ptrs.iter().map(|p| Arg::Ptr(*p)).collect();
        args.push(Arg::Ptr(out_ptr(&stats)?));
        args.push(Arg::Ptr(out_ptr(&dw)?));
        args.push(Arg::Ptr(db.as_ref().map_or(Ok(0), out_ptr)?));
        args.push(Arg::I32(rows.rows as i32));
        args.extend(rows.args());
        args.push(act);
        let name = format!("norm_affine_bwd_params_{}", suffix(dt)?);
        launch(&dev, &name, (channels as u32, 1), 256, &args)?;
    }
    let param = |s: CudaStorage, like: &Tensor| {
        into_tensor(s, channels)
            .to_dtype(like.dtype())?
            .reshape(like.shape())
    };
    let dw = param(dw, w)?;
    let db = match (db, b) {
        (Some(s), Some(b)) => Some(param(s, b)?),
        _ => None,
    };
    Ok((into_tensor(dx, x.shape().clone()), dw, db))
}
