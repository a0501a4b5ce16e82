//! `cargo run -p ft-kernels --example conv_bench` : forward and forward + backward time of a 3x3
//! convolution on CPU, candle's `conv2d` next to `ft_kernels::conv::conv2d`, at UNet-like shapes
//! (the measurement behind replacing candle's conv2d in every model) and a ResNet10 episode's
//! (85 images of 84 px: 5-way 1-shot with 16 queries a class; its four stages, the deep ones'
//! images multiplied in groups). The median of `CONV_BENCH_REPS`
//! runs (default 15) after a warm-up: this VM's noise moves a mean by more than a change to one
//! of the op's loops. The last column is our forward + backward with the input outside the
//! graph: the weight gradient alone, as a network's first layer takes it.

use std::time::Instant;

use candle_core::{Device, Result, Tensor, Var};

fn reps() -> usize {
    std::env::var("CONV_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15)
        .max(1)
}

/// Milliseconds of `f`, the median of [`reps`] runs after a warm-up.
fn time(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    let mut ms = Vec::new();
    for _ in 0..reps() {
        let t0 = Instant::now();
        f()?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// On one of rayon's threads with candle's pool settled (`threads::run`), as the binaries run:
/// outside it candle's pool threads spin after each large op and took a core from the
/// convolution's threads (docs/benchmarks.md).
fn main() -> Result<()> {
    ft_kernels::threads::run(bench)
}

fn bench() -> Result<()> {
    let dev = Device::Cpu;
    println!(
        "3x3 conv, padding 1, f32, CPU, the input's gradient too (median of {} runs after a warm-up)\n",
        reps()
    );
    println!(
        "| images | channels | size | candle fwd | candle fwd+bwd | ours fwd | ours fwd+bwd | ours fwd+bwd, weight only |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (b, c, s) in [
        (1usize, 64usize, 32usize),
        (1, 128, 16),
        (1, 256, 8),
        (85, 64, 21),
        (85, 128, 11),
        (85, 256, 6),
        (85, 512, 3),
    ] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., (b, c, s, s), &dev)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.1, (c, c, 3, 3), &dev)?)?;
        let (xt, wt) = (x.as_tensor(), w.as_tensor());
        let candle_f = time(|| xt.conv2d(wt, 1, 1, 1, 1).map(|_| ()))?;
        let candle_fb = time(|| {
            xt.conv2d(wt, 1, 1, 1, 1)?.sum_all()?.backward()?;
            Ok(())
        })?;
        let ours_f = time(|| ft_kernels::conv::conv2d(xt, wt, None, 1, 1).map(|_| ()))?;
        let ours_fb = time(|| {
            ft_kernels::conv::conv2d(xt, wt, None, 1, 1)?
                .sum_all()?
                .backward()?;
            Ok(())
        })?;
        let outside = xt.detach();
        let ours_w = time(|| {
            ft_kernels::conv::conv2d(&outside, wt, None, 1, 1)?
                .sum_all()?
                .backward()?;
            Ok(())
        })?;
        println!(
            "| {b} | {c} | {s}x{s} | {candle_f:.2} ms | {candle_fb:.2} ms | {ours_f:.2} ms | {ours_fb:.2} ms | {ours_w:.2} ms |"
        );
    }
    Ok(())
}
