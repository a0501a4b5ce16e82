//! Softmax and normalisation over rows, nearest 2x upsampling and pooling over planes: one
//! kernel per pass, forward and backward, f32 arithmetic on f32/bf16/f16 data.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, Layout, Result, Tensor};

use super::{
    device_of, dptr, elem_grid, into_tensor, launch, out_ptr, output, suffix, tensor_ptr, Arg,
};

/// (rows, cols) of a contiguous layout reduced over its last dimension.
fn rows_cols(l: &Layout) -> Result<(usize, usize)> {
    let cols = l.dims().last().copied().unwrap_or(1).max(1);
    let n = l.shape().elem_count();
    if cols > i32::MAX as usize || n / cols > i32::MAX as usize {
        candle_core::bail!("row kernel: {:?} is too large", l.dims());
    }
    Ok((n / cols, cols))
}

/// One block per row: a warp for short rows, up to 512 threads for long ones.
fn row_block(cols: usize) -> u32 {
    (cols.div_ceil(32) * 32).clamp(32, 512) as u32
}

fn row_kernel(
    name: &str,
    s: &CudaStorage,
    l: &Layout,
    inputs: &[u64],
    tail: &[Arg],
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l)?;
    let dt = s.dtype();
    let out = output(&s.device, dt, rows * cols)?;
    let mut args: Vec<Arg> = inputs.iter().map(|p| Arg::Ptr(*p)).collect();
    args.push(Arg::Ptr(out_ptr(&out)?));
    args.push(Arg::I32(cols as i32));
    args.extend_from_slice(tail);
    launch(
        &s.device,
        &format!("{name}_{}", suffix(dt)?),
        (rows as u32, 1),
        row_block(cols),
        &args,
    )?;
    Ok(out)
}

/// Softmax (or log-softmax) over the last dimension.
pub(crate) fn softmax_forward(s: &CudaStorage, l: &Layout, log: bool) -> Result<CudaStorage> {
    row_kernel("softmax_fwd", s, l, &[dptr(s, l)?], &[Arg::I32(log as i32)])
}

/// The input gradient of [`softmax_forward`] from its output `y` and the output gradient `g`.
pub(crate) fn softmax_backward(y: &Tensor, g: &Tensor, log: bool) -> Result<Tensor> {
    let y = y.contiguous()?;
    let g = g.to_dtype(y.dtype())?.contiguous()?;
    let out = super::with_storage(&y, |s, l| {
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
pub(crate) fn norm_backward(x: &Tensor, g: &Tensor, eps: f64, center: bool) -> Result<Tensor> {
    let x = x.contiguous()?;
    let g = g.to_dtype(x.dtype())?.contiguous()?;
    let out = super::with_storage(&x, |s, l| {
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

fn plane_dims(dims: &[usize]) -> Result<(usize, usize, usize)> {
    match dims {
        [n, c, h, w] => Ok((n * c, *h, *w)),
        d => candle_core::bail!("expected [N, C, H, W], got {d:?}"),
    }
}

/// [N, C, H, W] -> [N, C, 2H, 2W], each pixel repeated in a 2x2 block.
pub(crate) fn upsample2x_forward(s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    let (planes, h, w) = plane_dims(l.dims())?;
    let n = planes * 4 * h * w;
    let out = output(&s.device, s.dtype(), n)?;
    launch(
        &s.device,
        &format!("upsample2x_fwd_{}", suffix(s.dtype())?),
        (elem_grid(n), 1),
        256,
        &[
            Arg::Ptr(dptr(s, l)?),
            Arg::Ptr(out_ptr(&out)?),
            Arg::I64(planes as i64),
            Arg::I32(h as i32),
            Arg::I32(w as i32),
        ],
    )?;
    Ok(out)
}

/// The input gradient of [`upsample2x_forward`]: each input pixel sums its 2x2 block of `g`.
pub(crate) fn upsample2x_backward(g: &Tensor, input_dims: &[usize]) -> Result<Tensor> {
    let (planes, h, w) = plane_dims(input_dims)?;
    let g = g.contiguous()?;
    let dev = device_of(&g)?;
    let n = planes * h * w;
    let out = output(&dev, g.dtype(), n)?;
    launch(
        &dev,
        &format!("upsample2x_bwd_{}", suffix(g.dtype())?),
        (elem_grid(n), 1),
        256,
        &[
            Arg::Ptr(tensor_ptr(&g)?),
            Arg::Ptr(out_ptr(&out)?),
            Arg::I64(planes as i64),
            Arg::I32(h as i32),
            Arg::I32(w as i32),
        ],
    )?;
    Ok(into_tensor(out, input_dims))
}

/// Pool geometry: `kind` 0 is max (first maximum, NaN propagates), 1 average; floor mode.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolSpec {
    pub kind: i32,
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
}

impl PoolSpec {
    fn args(&self, planes: usize, h: usize, w: usize) -> [Arg; 7] {
        [
            Arg::I64(planes as i64),
            Arg::I32(h as i32),
            Arg::I32(w as i32),
            Arg::I32(self.kernel.0 as i32),
            Arg::I32(self.kernel.1 as i32),
            Arg::I32(self.stride.0 as i32),
            Arg::I32(self.stride.1 as i32),
        ]
    }
}

/// Pools [N, C, H, W] into [N, C, oh, ow] (the caller has checked that the window fits).
pub(crate) fn pool_forward(
    s: &CudaStorage,
    l: &Layout,
    spec: PoolSpec,
    out_hw: (usize, usize),
) -> Result<CudaStorage> {
    let (planes, h, w) = plane_dims(l.dims())?;
    let n = planes * out_hw.0 * out_hw.1;
    let out = output(&s.device, s.dtype(), n)?;
    let mut args = vec![Arg::Ptr(dptr(s, l)?), Arg::Ptr(out_ptr(&out)?)];
    args.extend(spec.args(planes, h, w));
    args.push(Arg::I32(spec.kind));
    launch(
        &s.device,
        &format!("pool_fwd_{}", suffix(s.dtype())?),
        (elem_grid(n), 1),
        256,
        &args,
    )?;
    Ok(out)
}

/// The input gradient of [`pool_forward`]: each input element gathers from the windows that
/// cover it (to the first maximum for max pooling, 1/k^2 of each for average).
pub(crate) fn pool_backward(x: &Tensor, g: &Tensor, spec: PoolSpec) -> Result<Tensor> {
    let x = x.contiguous()?;
    let g = g.to_dtype(x.dtype())?.contiguous()?;
    let (planes, h, w) = plane_dims(x.dims())?;
    let dev = device_of(&x)?;
    let n = planes * h * w;
    let out = output(&dev, x.dtype(), n)?;
    let mut args = vec![
        Arg::Ptr(tensor_ptr(&x)?),
        Arg::Ptr(tensor_ptr(&g)?),
        Arg::Ptr(out_ptr(&out)?),
    ];
    args.extend(spec.args(planes, h, w));
    args.push(Arg::I32(spec.kind));
    launch(
        &dev,
        &format!("pool_bwd_{}", suffix(x.dtype())?),
        (elem_grid(n), 1),
        256,
        &args,
    )?;
    Ok(into_tensor(out, x.shape()))
}
