//! Times the gated feed-forward (`src/cuda/gated.cu`) at FLAN-T5-XL's and the SDXL UNet's
//! shapes: the forward through `gated`/`gated_halves`, and forward plus backward through
//! candle's autograd (the backward one kernel writing both gradients). Each shape is first
//! checked against the CPU reference (the same op on the CPU).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_gated`

use candle_core::{DType, Device, Result, Tensor};
use ft_kernels::activation::Activation;
use ft_kernels::cuda::check::{check_and_time, gpu};
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
        // Bytes moved: the forward reads both operands and writes the product; forward and
        // backward together also read the gradient and both operands and write two.
        check_and_time(&dev, name, &inputs, &f, 2e-2, (3, 8))?;
    }
    Ok(())
}
