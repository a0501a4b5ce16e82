//! Times the gradient-norm kernels (`src/cuda/grad_norm.cu`): the global sum of squares of many
//! tensors with one read-back, each tensor's own sum with one read-back, and the f16 unscale
//! with its overflow check. Each is first checked against the CPU reference
//! (`ft_kernels::host::sum_squares`, f64 block sums; the unscale against its formula).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_grad_norm`

use candle_core::{DType, Device, Result, Tensor};
use ft_kernels::cuda::check::{gpu, report, time_us};
use ft_kernels::cuda::{sum_squares, sum_squares_each, unscale_check};
use ft_kernels::gradcheck::random_tensor;

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // 100 bf16 gradients of 1,638,400 values (a 1280 x 1280 weight): 164M values, a large
    // share of a checkpointed SDXL UNet segment's worth many times over.
    let (count, n) = (100, 1280 * 1280);
    let host: Vec<Tensor> = (0..count)
        .map(|i| random_tensor(&[n], i as u64, &Device::Cpu)?.to_dtype(DType::F32))
        .collect::<Result<_>>()?;
    let want: f64 = host
        .iter()
        .map(|t| ft_kernels::host::sum_squares(t).unwrap_or(f64::NAN))
        .sum();
    let grads: Vec<Tensor> = host
        .iter()
        .map(|t| t.to_dtype(DType::BF16)?.to_device(&dev))
        .collect::<Result<_>>()?;
    let opt: Vec<Option<Tensor>> = grads.iter().cloned().map(Some).collect();
    let got = sum_squares(&opt)?;
    assert!(
        (got - want).abs() <= 1e-2 * want,
        "sum of squares {got} vs {want}"
    );
    let bytes = (count * n * 2) as u64;
    let us = time_us(&dev, 20, || sum_squares(&opt).map(|_| ()))?;
    report(
        &format!("sum of squares, {count} x {n} bf16"),
        us,
        Some(bytes),
    );
    let us = time_us(&dev, 20, || sum_squares_each(&grads).map(|_| ()))?;
    report(
        &format!("sums of squares each, {count} x {n} bf16"),
        us,
        Some(bytes),
    );

    let f16: Vec<Option<Tensor>> = grads
        .iter()
        .map(|g| Ok(Some(g.to_dtype(DType::F16)?)))
        .collect::<Result<_>>()?;
    let mut once = f16.clone();
    assert!(!unscale_check(&mut once, 0.5)?, "finite gradients flagged");
    let us = time_us(&dev, 20, || {
        let mut g = f16.clone();
        unscale_check(&mut g, 1.0 / 65536.0).map(|_| ())
    })?;
    // Reads f16, writes fp32.
    report(
        &format!("unscale + check, {count} x {n} f16"),
        us,
        Some(3 * bytes),
    );
    Ok(())
}
