//! Times the gated feed-forward (`src/cuda/gated.cu`) at FLAN-T5-XL's and the SDXL UNet's
//! shapes: the forward through `gated`/`gated_halves`, and forward plus backward through
//! candle's autograd (the backward one kernel writing both gradients). Each shape is first
//! checked against the CPU reference (the same op on the CPU).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_gated`

use candle_core::{DType, Device, Result, Tensor};
use ft_kernels::activation::Activation;
use ft_kernels::cuda::check::{assert_matches, forward_backward, gpu, report, time_us};
use ft_kernels::gated::{gated, gated_halves};
use ft_kernels::gradcheck::random_tensor;

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // (name, operands' shape, GEGLU's halves or T5's two tensors, activation)
    let cases: [(&str, [usize; 3], bool, Activation); 3] = [
        // FLAN-T5-XL's encoder feed-forward at batch 8 x 512 tokens.
        ("t5-xl ff", [8, 512, 5120], false, Activation::GeluTanh),
        // The SDXL UNet's GEGLU at 1024 px: 4096 tokens of 640, 1024 of 1280 (width 2 x 4 d).
        (
            "sdxl geglu 640",
            [1, 4096, 2 * 2560],
            true,
            Activation::GeluErf,
        ),
        (
            "sdxl geglu 1280",
            [1, 1024, 2 * 5120],
            true,
            Activation::GeluErf,
        ),
    ];
    for (name, dims, halves, act) in cases {
        let count = if halves { 1 } else { 2 };
        let inputs: Vec<Tensor> = (0..count)
            .map(|i| random_tensor(&dims, 5 + i, &Device::Cpu)?.to_dtype(DType::F32))
            .collect::<Result<_>>()?;
        let f = |t: &[Tensor]| {
            if halves {
                gated_halves(&t[0], act)
            } else {
                gated(&t[0], &t[1], act)
            }
        };
        let want = forward_backward(&inputs, &f)?;
        for dt in [DType::F32, DType::BF16] {
            let xs: Vec<Tensor> = inputs
                .iter()
                .map(|t| t.to_dtype(dt)?.to_device(&dev))
                .collect::<Result<_>>()?;
            let got = forward_backward(&xs, &f)?;
            let tol = if dt == DType::F32 { 1e-4 } else { 2e-2 };
            assert_matches(&format!("{name} {dt:?}"), &got, &want, tol)?;
            // Bytes moved: the forward reads both operands and writes the product; forward and
            // backward together also read the gradient and both operands and write two.
            let n = got.0.elem_count() * dt.size_in_bytes();
            let us = time_us(&dev, 20, || f(&xs).map(|_| ()))?;
            report(&format!("{name} fwd {dt:?}"), us, Some(3 * n as u64));
            let us = time_us(&dev, 20, || forward_backward(&xs, &f).map(|_| ()))?;
            report(&format!("{name} fwd+bwd {dt:?}"), us, Some(8 * n as u64));
        }
    }
    Ok(())
}
