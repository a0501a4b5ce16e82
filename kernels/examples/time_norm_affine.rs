//! Times the norms with their weight, bias and activation as one op (`src/cuda/norm_affine.cu`)
//! at FLAN-T5-XL's and the SDXL UNet's shapes: the forward, and forward plus backward through
//! candle's autograd (the input's gradient a row a block, then the parameters' sums a channel
//! a block). Each shape is first checked against the CPU reference (the same op on the CPU).
//! The separate ops it replaces run with `FT_NORM_OP=0`, for the comparison.
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_norm_affine`

use candle_core::{DType, Device, Result, Tensor};
use ft_kernels::activation::Activation;
use ft_kernels::cuda::check::{check_and_time, gpu};
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
        // Bytes moved: the forward reads the input twice (statistics, values) and writes the
        // output; the backward reads the input and the gradient three times (two passes a row,
        // one a channel) and writes the input's gradient.
        check_and_time(&dev, name, &inputs, &f, 3e-2, (3, 11))?;
    }
    Ok(())
}
