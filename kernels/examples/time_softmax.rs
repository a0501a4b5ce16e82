//! Times the softmax kernels (`src/cuda/softmax.cu`) at the models' shapes: the forward through
//! `softmax_last_dim`, the backward through its launcher, in f32 and bf16. Each shape is first
//! checked against the CPU reference (the same op on the CPU, f64 per row).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_softmax`

use candle_core::{DType, Device, Result};
use ft_kernels::cuda::check::{gpu, max_rel_diff, report, time_us};
use ft_kernels::gradcheck::random_tensor;
use ft_kernels::softmax::softmax_last_dim;

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // (rows, cols): SDXL cross-attention scores at 1024 px (heads x queries, 77 tokens), a T5
    // self-attention row block (512 keys), a long row.
    for (rows, cols) in [(10 * 4096, 77), (32 * 512, 512), (256, 32_768)] {
        let x = random_tensor(&[rows, cols], 1, &Device::Cpu)?.to_dtype(DType::F32)?;
        let want = softmax_last_dim(&x)?;
        for dt in [DType::F32, DType::BF16] {
            let xg = x.to_dtype(dt)?.to_device(&dev)?;
            let y = softmax_last_dim(&xg)?;
            let err = max_rel_diff(&y, &want)?;
            let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
            assert!(
                err < tol,
                "{rows}x{cols} {dt:?}: differs from the CPU by {err:.2e}"
            );
            let bytes = 2 * (rows * cols * dt.size_in_bytes()) as u64;
            let us = time_us(&dev, 50, || softmax_last_dim(&xg).map(|_| ()))?;
            report(
                &format!("softmax fwd {rows}x{cols} {dt:?}"),
                us,
                Some(bytes),
            );
            let g = y.ones_like()?;
            let us = time_us(&dev, 50, || {
                ft_kernels::cuda::softmax_backward(&y, &g, false).map(|_| ())
            })?;
            report(
                &format!("softmax bwd {rows}x{cols} {dt:?}"),
                us,
                Some(bytes * 3 / 2),
            );
        }
    }
    Ok(())
}
