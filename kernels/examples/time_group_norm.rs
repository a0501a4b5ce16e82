//! Times group norm + SiLU (the one op of `norm_affine`, as every UNet ResNet block runs it) on
//! the CPU at the shapes of `sdxl_bench`'s mid-size UNet at 256 px (a 32 x 32 latent, one
//! image, 32 groups): channels 64 at 32 x 32, 128 at 16 x 16 and 256 at 8 x 8. One forward, and
//! one backward from the output (which includes candle's backward of the `mul` and `sum_all`
//! that seed it, and its zeroed slots), summed over the three shapes, each repeated 50 times.
//!
//! Then layer norm (weight and bias) and RMS norm (weight) over rows of 512, as the
//! t5-small-sized bench's (2048 rows), where each channel is one value.
//!
//! `cargo run --release -p ft-kernels --example time_group_norm` (`FT_WIDE_SIMD=0` for the
//! baseline-compiled loops)

use std::time::Instant;

use candle_core::{Device, Result, Tensor, Var};
use ft_kernels::activation::Activation;
use ft_kernels::norm::{group_norm_act, layer_norm, rms_norm};

fn main() -> Result<()> {
    // On one of rayon's threads, as the binaries run their steps.
    ft_kernels::threads::run(time)
}

fn time() -> Result<()> {
    let dev = Device::Cpu;
    let shapes = [(64, 32), (128, 16), (256, 8)];
    let reps = 50;
    let (mut fwd, mut bwd) = (0f64, 0f64);
    for (c, h) in shapes {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, c, h, h), &dev)?)?;
        let w = Var::from_tensor(&Tensor::randn(1f32, 0.1, c, &dev)?)?;
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.1, c, &dev)?)?;
        let g = Tensor::randn(0f32, 1.0, (1, c, h, h), &dev)?;
        for _ in 0..reps {
            let t = Instant::now();
            let y = group_norm_act(&x, 32, Some(&w), Some(&b), 1e-5, Activation::Silu)?;
            fwd += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let grads = (y * &g)?.sum_all()?.backward()?;
            bwd += t.elapsed().as_secs_f64();
            std::hint::black_box(grads.get(&x));
        }
    }
    println!(
        "group norm + SiLU, [1, 64, 32, 32] + [1, 128, 16, 16] + [1, 256, 8, 8] f32 ({}): \
         forward {:.3} ms, backward {:.3} ms",
        ft_kernels::wide::unit(),
        fwd / reps as f64 * 1e3,
        bwd / reps as f64 * 1e3
    );
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2048, 512), &dev)?)?;
    let w = Var::from_tensor(&Tensor::randn(1f32, 0.1, 512, &dev)?)?;
    let b = Var::from_tensor(&Tensor::randn(0f32, 0.1, 512, &dev)?)?;
    let g = Tensor::randn(0f32, 1.0, (2048, 512), &dev)?;
    for name in ["layer", "RMS"] {
        let (mut fwd, mut bwd) = (0f64, 0f64);
        for _ in 0..reps {
            let t = Instant::now();
            let y = if name == "layer" {
                layer_norm(&x, Some(&w), Some(&b), 1e-5)?
            } else {
                rms_norm(&x, Some(&w), 1e-6)?
            };
            fwd += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let grads = (y * &g)?.sum_all()?.backward()?;
            bwd += t.elapsed().as_secs_f64();
            std::hint::black_box(grads.get(&x));
        }
        println!(
            "{name} norm [2048, 512] f32: forward {:.3} ms, backward {:.3} ms",
            fwd / reps as f64 * 1e3,
            bwd / reps as f64 * 1e3
        );
    }
    Ok(())
}
