//! Times max and average pooling (`src/cuda/pool.cu`) at the few-shot backbones' shapes: the
//! forward through `max_pool2d` / `avg_pool2d`, the backward through its launcher. Each shape is
//! first checked against the CPU reference (the same op on the CPU).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_pool`

use candle_core::{DType, Device, Result};
use ft_kernels::cuda::check::{gpu, max_rel_diff, report, time_us};
use ft_kernels::cuda::PoolSpec;
use ft_kernels::gradcheck::random_tensor;
use ft_kernels::pool::{avg_pool2d, max_pool2d};

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // Conv4's first block on a 5-way 16-query episode at 84 px, and a ResNet stem at 224 px.
    for dims in [[85, 64, 84, 84], [85, 64, 112, 112]] {
        let x = random_tensor(&dims, 4, &Device::Cpu)?.to_dtype(DType::F32)?;
        for (name, kind) in [("max", 0), ("avg", 1)] {
            let f = |x: &candle_core::Tensor| {
                if kind == 0 {
                    max_pool2d(x, (2, 2), (2, 2))
                } else {
                    avg_pool2d(x, (2, 2), (2, 2))
                }
            };
            let want = f(&x)?;
            let xg = x.to_device(&dev)?;
            let err = max_rel_diff(&f(&xg)?, &want)?;
            assert!(err < 1e-6, "{name} {dims:?}: off by {err:.2e}");
            let n = (dims.iter().product::<usize>() * 4) as u64;
            let us = time_us(&dev, 20, || f(&xg).map(|_| ()))?;
            report(
                &format!("{name} pool 2x2 fwd {dims:?}"),
                us,
                Some(n + n / 4),
            );
            let g = f(&xg)?.ones_like()?;
            let spec = PoolSpec {
                kind,
                kernel: (2, 2),
                stride: (2, 2),
            };
            let us = time_us(&dev, 20, || {
                ft_kernels::cuda::pool_backward(&xg, &g, spec).map(|_| ())
            })?;
            report(
                &format!("{name} pool 2x2 bwd {dims:?}"),
                us,
                Some(2 * n + n / 4),
            );
        }
    }
    Ok(())
}
