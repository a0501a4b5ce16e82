//! Max and average pooling of [N, C, H, W] (`pool.cu`), any kernel and stride, floor mode:
//! grid-stride loops; the backward gathers from every window that covers an input element (no
//! atomics).
//!
//! - CPU reference: `crate::pool` (`Pool::cpu_fwd`).
//! - GPU check: `tests/cuda/ops.rs` (`every_op_matches_its_cpu_reference`); logic without a
//!   GPU: `tests/emulated` (`pool_case`).
//! - Timing: `cargo run --release --features cuda -p ft-kernels --example time_pool`.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, Layout, Result, Tensor};

use super::launch::{
    device_of, dptr, elem_grid, into_tensor, launch, out_ptr, output, plane_dims, suffix,
    tensor_ptr, Arg,
};

/// Pool geometry: `kind` 0 is max (first maximum, NaN propagates), 1 average; floor mode.
#[derive(Debug, Clone, Copy)]
pub struct PoolSpec {
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
pub fn pool_backward(x: &Tensor, g: &Tensor, spec: PoolSpec) -> Result<Tensor> {
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
