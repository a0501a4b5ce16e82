//! `cargo run -p ft-kernels --example conv_bench` : forward and forward + backward time of a 3x3
//! convolution on CPU, candle's `conv2d` next to `ft_kernels::conv::conv2d`, at UNet-like shapes
//! (the measurement behind replacing candle's conv2d in every model).

use std::time::Instant;

use candle_core::{Device, Result, Tensor, Var};

const REPS: usize = 5;

fn time(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    let t0 = Instant::now();
    for _ in 0..REPS {
        f()?;
    }
    Ok(t0.elapsed().as_secs_f64() / REPS as f64 * 1e3)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    println!("3x3 conv, padding 1, batch 1, f32, CPU ({REPS} runs after a warm-up)\n");
    println!("| channels | size | candle fwd | candle fwd+bwd | ours fwd | ours fwd+bwd |");
    println!("|---|---|---|---|---|---|");
    for (c, s) in [(64usize, 32usize), (128, 16), (256, 8)] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., (1, c, s, s), &dev)?)?;
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
        println!(
            "| {c} | {s}x{s} | {candle_f:.2} ms | {candle_fb:.2} ms | {ours_f:.2} ms | {ours_fb:.2} ms |"
        );
    }
    Ok(())
}
