//! Times nearest 2x upsampling (`src/cuda/upsample.cu`) at the SDXL UNet's up-block shapes: the
//! forward through `upsample_nearest2x`, the backward through its launcher. Each shape is first
//! checked against the CPU reference (the same op on the CPU).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_upsample`

use candle_core::{DType, Device, Result};
use ft_kernels::cuda::check::{gpu, max_rel_diff, report, time_us};
use ft_kernels::gradcheck::random_tensor;
use ft_kernels::upsample::upsample_nearest2x;

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // [N, C, H, W]: the UNet's two upsamplers at 1024 px (latents 128 x 128).
    for dims in [[1, 1280, 32, 32], [1, 640, 64, 64]] {
        let x = random_tensor(&dims, 3, &Device::Cpu)?.to_dtype(DType::F32)?;
        let want = upsample_nearest2x(&x)?;
        for dt in [DType::F32, DType::BF16] {
            let xg = x.to_dtype(dt)?.to_device(&dev)?;
            let y = upsample_nearest2x(&xg)?;
            let err = max_rel_diff(&y, &want)?;
            assert!(
                err == 0.0 || (dt == DType::BF16 && err < 1e-2),
                "{dims:?} {dt:?}: {err:.2e}"
            );
            let n = dims.iter().product::<usize>() * dt.size_in_bytes();
            let us = time_us(&dev, 50, || upsample_nearest2x(&xg).map(|_| ()))?;
            report(
                &format!("upsample2x fwd {dims:?} {dt:?}"),
                us,
                Some(5 * n as u64),
            );
            let g = y.ones_like()?;
            let us = time_us(&dev, 50, || {
                ft_kernels::cuda::upsample2x_backward(&g, &dims).map(|_| ())
            })?;
            report(
                &format!("upsample2x bwd {dims:?} {dt:?}"),
                us,
                Some(5 * n as u64),
            );
        }
    }
    Ok(())
}
