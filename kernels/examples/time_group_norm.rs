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

const REPS: usize = 50;

/// Seconds summed over [`REPS`] runs of `f(x)` (the forward) and of the backward from
/// `sum(f(x) * g)`.
fn fwd_bwd(x: &Var, g: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<(f64, f64)> {
    let (mut fwd, mut bwd) = (0f64, 0f64);
    for _ in 0..REPS {
        let t = Instant::now();
        let y = f(x.as_tensor())?;
        fwd += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let grads = (y * g)?.sum_all()?.backward()?;
        bwd += t.elapsed().as_secs_f64();
        std::hint::black_box(grads.get(x));
    }
    Ok((fwd, bwd))
}

/// Milliseconds a run.
fn ms(s: f64) -> f64 {
    s / REPS as f64 * 1e3
}

fn time() -> Result<()> {
    let dev = Device::Cpu;
    let randn = |mean: f32, std: f32, shape: &[usize]| Tensor::randn(mean, std, shape, &dev);
    // Weights and biases are variables, so that candle's backward makes their gradients too.
    let var = |mean: f32, std: f32, shape: &[usize]| Var::from_tensor(&randn(mean, std, shape)?);
    let (mut fwd, mut bwd) = (0f64, 0f64);
    for (c, h) in [(64, 32), (128, 16), (256, 8)] {
        let x = var(0.0, 1.0, &[1, c, h, h])?;
        let (w, b) = (var(1.0, 0.1, &[c])?, var(0.0, 0.1, &[c])?);
        let g = randn(0.0, 1.0, &[1, c, h, h])?;
        let (f, bk) = fwd_bwd(&x, &g, |x| {
            group_norm_act(x, 32, Some(&w), Some(&b), 1e-5, Activation::Silu)
        })?;
        fwd += f;
        bwd += bk;
    }
    println!(
        "group norm + SiLU, [1, 64, 32, 32] + [1, 128, 16, 16] + [1, 256, 8, 8] f32 ({}): \
         forward {:.3} ms, backward {:.3} ms",
        ft_kernels::wide::unit(),
        ms(fwd),
        ms(bwd)
    );
    let x = var(0.0, 1.0, &[2048, 512])?;
    let (w, b) = (var(1.0, 0.1, &[512])?, var(0.0, 0.1, &[512])?);
    let g = randn(0.0, 1.0, &[2048, 512])?;
    let (lf, lb) = fwd_bwd(&x, &g, |x| layer_norm(x, Some(&w), Some(&b), 1e-5))?;
    let (rf, rb) = fwd_bwd(&x, &g, |x| rms_norm(x, Some(&w), 1e-6))?;
    for (name, f, b) in [("layer", lf, lb), ("RMS", rf, rb)] {
        println!(
            "{name} norm [2048, 512] f32: forward {:.3} ms, backward {:.3} ms",
            ms(f),
            ms(b)
        );
    }
    Ok(())
}
