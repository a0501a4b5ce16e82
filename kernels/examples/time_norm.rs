//! Times the layer/RMS norm kernels (`src/cuda/norm.cu`) at the models' shapes: the forward
//! through `layer_norm` / `rms_norm` (no affine), the backward through its launcher. Each shape
//! is first checked against the CPU reference (the same op on the CPU, f64 per row).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_norm`

use candle_core::{DType, Device, Result};
use ft_kernels::cuda::check::{gpu, max_rel_diff, report, time_us};
use ft_kernels::gradcheck::random_tensor;
use ft_kernels::norm::{layer_norm, rms_norm};

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // (rows, cols): SDXL's transformer tokens at 1024 px (4096 x 640, 1024 x 1280), FLAN-T5-XL
    // (8 x 512 tokens of 2048).
    for (rows, cols) in [(4096, 640), (1024, 1280), (8 * 512, 2048)] {
        let x = random_tensor(&[rows, cols], 2, &Device::Cpu)?.to_dtype(DType::F32)?;
        for (name, center) in [("layer", true), ("rms", false)] {
            let f = |x: &candle_core::Tensor| {
                if center {
                    layer_norm(x, None, None, 1e-5)
                } else {
                    rms_norm(x, None, 1e-6)
                }
            };
            let want = f(&x)?;
            for dt in [DType::F32, DType::BF16] {
                let xg = x.to_dtype(dt)?.to_device(&dev)?;
                let err = max_rel_diff(&f(&xg)?, &want)?;
                let tol = if dt == DType::F32 { 1e-5 } else { 2e-2 };
                assert!(err < tol, "{name} {rows}x{cols} {dt:?}: off by {err:.2e}");
                let bytes = 2 * (rows * cols * dt.size_in_bytes()) as u64;
                let us = time_us(&dev, 50, || f(&xg).map(|_| ()))?;
                report(
                    &format!("{name} norm fwd {rows}x{cols} {dt:?}"),
                    us,
                    Some(bytes),
                );
                let g = xg.ones_like()?;
                let eps = if center { 1e-5 } else { 1e-6 };
                let us = time_us(&dev, 50, || {
                    ft_kernels::cuda::norm_backward(&xg, &g, eps, center).map(|_| ())
                })?;
                report(
                    &format!("{name} norm bwd {rows}x{cols} {dt:?}"),
                    us,
                    Some(bytes * 3 / 2),
                );
            }
        }
    }
    Ok(())
}
