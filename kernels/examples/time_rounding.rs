//! Times fp32 -> bf16 stochastic rounding (`src/cuda/rounding.cu`). First checked against the
//! CPU reference (`ft_kernels::rounding` on the CPU gives the same bits for a seed).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_rounding`

use candle_core::{DType, Device, Result};
use ft_kernels::cuda::check::{gpu, report, time_us};
use ft_kernels::gradcheck::random_tensor;
use ft_kernels::rounding::round_stochastic_bf16;

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for n in [1 << 20, 65_798_144] {
        let x = random_tensor(&[n], 9, &Device::Cpu)?.to_dtype(DType::F32)?;
        let want = round_stochastic_bf16(&x, 42)?;
        let xg = x.to_device(&dev)?;
        let got = round_stochastic_bf16(&xg, 42)?.to_device(&Device::Cpu)?;
        let same = (got.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(same, 0.0, "the GPU's bits differ from the CPU's");
        let us = time_us(&dev, 50, || round_stochastic_bf16(&xg, 42).map(|_| ()))?;
        report(
            &format!("stochastic round to bf16, {n} values"),
            us,
            Some(6 * n as u64),
        );
    }
    Ok(())
}
