//! Nearest 2x upsampling of [N, C, H, W] (`upsample.cu`), forward and backward (each input pixel
//! sums its 2x2 block of the gradient, where candle overwrites): grid-stride loops.
//!
//! - CPU reference: `crate::upsample` (`Upsample2x::cpu_fwd`).
//! - GPU check: `tests/cuda/ops.rs` (`every_op_matches_its_cpu_reference`); logic without a
//!   GPU: `tests/emulated` (`upsample_case`).
//! - Timing: `cargo run --release --features cuda -p ft-kernels --example time_upsample`.

use candle_core::backend::BackendStorage;
use candle_core::{CudaStorage, Layout, Result, Tensor};

use super::launch::{
    device_of, dptr, elem_grid, into_tensor, launch, out_ptr, output, plane_dims, suffix,
    tensor_ptr, Arg,
};

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
pub fn upsample2x_backward(g: &Tensor, input_dims: &[usize]) -> Result<Tensor> {
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
