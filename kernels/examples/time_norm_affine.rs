//! Times the norms with their weight, bias and activation as one op (`src/cuda/norm_affine.cu`)
//! at FLAN-T5-XL's and the SDXL UNet's shapes: the forward, and forward plus backward through
//! candle's autograd (the input's gradient a row a block, then the parameters' sums a channel
//! a block). Each shape is first checked against the CPU reference (the same op on the CPU).
//! The separate ops it replaces run with `FT_NORM_OP=0`, for the comparison.
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_norm_affine`

use candle_core::{DType, Device, Result, Tensor};
use ft_kernels::activation::Activation;
use ft_kernels::cuda::check::{assert_matches, forward_backward, gpu, report, time_us};
use ft_kernels::gradcheck::random_tensor;
use ft_kernels::norm::{group_norm_act, rms_norm};

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    type Op = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;
    // (name, input shape, channels, the op)
    let cases: Vec<(&str, Vec<usize>, usize, Op)> = vec![
        // FLAN-T5-XL's RMS norm at batch 8 x 512 tokens.
        (
            "t5-xl rms_norm",
            vec![8, 512, 2048],
            2048,
            Box::new(|t| rms_norm(&t[0], Some(&t[1]), 1e-6)),
        ),
        // The SDXL UNet's first ResNet norm at 1024 px: 320 channels of 128 x 128, 32 groups.
        (
            "sdxl group_norm+silu 320",
            vec![1, 320, 128, 128],
            320,
            Box::new(|t| {
                group_norm_act(&t[0], 32, Some(&t[1]), Some(&t[2]), 1e-5, Activation::Silu)
            }),
        ),
    ];
    for (name, dims, channels, f) in cases {
        let with_bias = name.contains("group");
        let mut inputs = vec![random_tensor(&dims, 5, &Device::Cpu)?.to_dtype(DType::F32)?];
        inputs.push((random_tensor(&[channels], 6, &Device::Cpu)? + 1.0)?.to_dtype(DType::F32)?);
        if with_bias {
            inputs.push(random_tensor(&[channels], 7, &Device::Cpu)?.to_dtype(DType::F32)?);
        }
        let want = forward_backward(&inputs, &f)?;
        for dt in [DType::F32, DType::BF16] {
            let xs: Vec<Tensor> = inputs
                .iter()
                .map(|t| t.to_dtype(dt)?.to_device(&dev))
                .collect::<Result<_>>()?;
            let got = forward_backward(&xs, &f)?;
            let tol = if dt == DType::F32 { 1e-4 } else { 3e-2 };
            assert_matches(&format!("{name} {dt:?}"), &got, &want, tol)?;
            // Bytes moved: the forward reads the input twice (statistics, values) and writes
            // the output; the backward reads the input and the gradient three times (two
            // passes a row, one a channel) and writes the input's gradient.
            let n = got.0.elem_count() * dt.size_in_bytes();
            let us = time_us(&dev, 20, || f(&xs).map(|_| ()))?;
            report(&format!("{name} fwd {dt:?}"), us, Some(3 * n as u64));
            let us = time_us(&dev, 20, || forward_backward(&xs, &f).map(|_| ()))?;
            report(&format!("{name} fwd+bwd {dt:?}"), us, Some(11 * n as u64));
        }
    }
    Ok(())
}
