//! Gradient sums of squares and the f16 unscale (`grad_norm.cu`): the global norm with one
//! read-back for all of a model's gradients, each tensor's norm into its own slot (per-tensor
//! clipping of a fused backward pass, a segment at a time), and unscale + inf/NaN check + cast
//! to fp32 in one pass with one flag read back.
//!
//! - CPU reference: `crate::host::sum_squares` (f64 block sums) and ft-trainer's
//!   `update::LossScaler::unscale` host path.
//! - GPU check: `tests/cuda/optim.rs` (`unscale_check_finds_overflow`,
//!   `sum_squares_matches_the_host`); logic without a GPU: `tests/emulated` (`sum_squares_case`,
//!   `unscale_case`, the double atomic under contention).
//! - Timing: `cargo run --release --features cuda -p ft-kernels --example time_grad_norm`.

use candle_core::{DType, Result, Tensor};

use super::launch::{
    device_of, elem_grid, into_tensor, launch, out_ptr, output, suffix, tensor_ptr, zeros, Arg,
};

/// Replaces every gradient by `g * inv_scale` in fp32 and reports whether any element is inf
/// or NaN, reading one flag back for all of them (a per-tensor check costs one host sync per
/// parameter: 1,680 for the SDXL UNet).
pub fn unscale_check(grads: &mut [Option<Tensor>], inv_scale: f64) -> Result<bool> {
    let Some(first) = grads.iter().flatten().next() else {
        return Ok(false);
    };
    let dev = device_of(first)?;
    let found = zeros(&dev, DType::I32, 1)?;
    let found_ptr = out_ptr(&found)?;
    for g in grads.iter_mut().flatten() {
        let src = g.contiguous()?;
        let n = src.elem_count();
        let out = output(&dev, DType::F32, n)?;
        launch(
            &dev,
            &format!("unscale_{}", suffix(src.dtype())?),
            (elem_grid(n), 1),
            256,
            &[
                Arg::Ptr(tensor_ptr(&src)?),
                Arg::Ptr(out_ptr(&out)?),
                Arg::I64(n as i64),
                Arg::F32(inv_scale as f32),
                Arg::Ptr(found_ptr),
            ],
        )?;
        *g = into_tensor(out, src.shape());
    }
    let flag = into_tensor(found, 1).to_vec1::<i32>()?;
    Ok(flag.first().copied().unwrap_or(0) != 0)
}

/// The sum of squares of every element of every gradient (f32/bf16/f16 on one CUDA device),
/// accumulated in f64 across blocks, with one read-back for all of them: the global norm for
/// gradient clipping is its square root.
pub fn sum_squares(grads: &[Option<Tensor>]) -> Result<f64> {
    let Some(first) = grads.iter().flatten().next() else {
        return Ok(0.0);
    };
    let dev = device_of(first)?;
    let acc = zeros(&dev, DType::F64, 1)?;
    let acc_ptr = out_ptr(&acc)?;
    for g in grads.iter().flatten() {
        add_squares(&dev, g, acc_ptr)?;
    }
    let total = into_tensor(acc, 1).to_vec1::<f64>()?;
    Ok(total.first().copied().unwrap_or(0.0))
}

/// The sum of squares of each tensor (f32/bf16/f16 on one CUDA device) apart, with one
/// read-back for all of them: per-tensor clipping (a fused backward pass) for a whole
/// checkpointed segment at once instead of one host sync per tensor.
pub fn sum_squares_each(grads: &[Tensor]) -> Result<Vec<f64>> {
    let Some(first) = grads.first() else {
        return Ok(Vec::new());
    };
    let dev = device_of(first)?;
    let acc = zeros(&dev, DType::F64, grads.len())?;
    let base = out_ptr(&acc)?;
    for (i, g) in grads.iter().enumerate() {
        add_squares(&dev, g, base + 8 * i as u64)?;
    }
    into_tensor(acc, grads.len()).to_vec1::<f64>()
}

/// Adds the squares of `g`'s elements into the f64 at `acc` (one kernel).
fn add_squares(dev: &candle_core::CudaDevice, g: &Tensor, acc: u64) -> Result<()> {
    let src = g.contiguous()?;
    let n = src.elem_count();
    launch(
        dev,
        &format!("sum_squares_{}", suffix(src.dtype())?),
        (elem_grid(n).min(1024), 1),
        256,
        &[
            Arg::Ptr(tensor_ptr(&src)?),
            Arg::I64(n as i64),
            Arg::Ptr(acc),
        ],
    )
}
