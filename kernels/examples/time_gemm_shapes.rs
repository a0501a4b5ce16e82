//! `cargo run --release -p ft-kernels --example time_gemm_shapes`: GFLOP/s of the `gemm` crate's
//! f32 product on one thread, on its own rayon threads, and cut into one block a thread by
//! `ft_kernels::gemm_blocks::product`, at the shapes the convolution and the linear layers run
//! (an FSCT ResNet10 episode's layers, a part of a weight gradient, UNet layers) and a large
//! one. The measurement behind `conv`'s choice of putting small products on rayon's threads one
//! each (`TASK_MACS`) rather than splitting each over gemm's threads, and behind `gemm_blocks`.
//! Then the linear layer's forward (`ft_kernels::linear::linear`, which copies a weight whose
//! rows would fall in one cache set into rows spread over the sets) against candle's product
//! with the transposed weight, at the t5-small-sized bench's shapes.

use std::time::Instant;

use ft_kernels::gemm_blocks::{product, Mat};

/// How a product uses the threads.
#[derive(Clone, Copy)]
enum Mode {
    /// One thread.
    One,
    /// gemm's own rayon threads.
    GemmThreads,
    /// `ft_kernels::gemm_blocks::product`: the long output axis in blocks, one a rayon task.
    Blocks,
}

/// GFLOP/s of `m x k` by `k x n` into `m x n` (row-major), best of three rounds of ~1 GFLOP.
fn gflops(m: usize, n: usize, k: usize, mode: Mode) -> f64 {
    let a = vec![0.5f32; m * k];
    let b = vec![0.25f32; k * n];
    let mut c = vec![0f32; m * n];
    let reps = (1e9 / (2.0 * (m * n * k) as f64)).ceil() as usize;
    let mut run = || match mode {
        Mode::One | Mode::Blocks => {
            let threads = matches!(mode, Mode::Blocks);
            product(
                &mut c,
                Mat::new(&a, false),
                Mat::new(&b, false),
                m,
                n,
                k,
                true,
                threads,
            )
            .expect("operand lengths match the shape");
        }
        // SAFETY: a, b and c hold m*k, k*n and m*n values, addressed with these row-major
        // strides; c does not alias a or b.
        Mode::GemmThreads => unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                n as isize,
                true,
                a.as_ptr(),
                1,
                k as isize,
                b.as_ptr(),
                1,
                n as isize,
                1f32,
                1f32,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(0),
            )
        },
    };
    run();
    (0..3)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                run();
            }
            2.0 * (m * n * k * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// Milliseconds a call of `f`, best of three rounds of `reps` calls after one warm-up call.
fn best_ms(
    reps: usize,
    mut f: impl FnMut() -> candle_core::Result<()>,
) -> candle_core::Result<f64> {
    f()?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        best = best.min(t.elapsed().as_secs_f64() * 1e3 / reps as f64);
    }
    Ok(best)
}

/// The linear layer's forward at `rows` x `din` -> `dout`: ours and candle's, in ms.
fn linear_ms(rows: usize, din: usize, dout: usize) -> candle_core::Result<(f64, f64)> {
    use candle_core::{Device, Tensor};
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (rows, din), &dev)?;
    let w = Tensor::randn(0f32, 0.05, (dout, din), &dev)?;
    let reps = (1e9 / (2.0 * (rows * din * dout) as f64)).ceil() as usize;
    let ours = best_ms(reps, || {
        ft_kernels::linear::linear(&x, &w, None).map(|_| ())
    })?;
    let candle = best_ms(reps, || x.matmul(&w.t()?).map(|_| ()))?;
    Ok((ours, candle))
}

fn main() -> candle_core::Result<()> {
    ft_kernels::threads::settle();
    println!(
        "gemm f32, GFLOP/s (best of 3), {} rayon threads\n",
        rayon::current_num_threads()
    );
    println!("| m x n x k | what | one thread | gemm's threads | `gemm_blocks::product` |");
    println!("|---|---|---|---|---|");
    for (m, n, k, what) in [
        (64, 441, 576, "ResNet10 stage 1 forward, one image"),
        (64, 64, 441, "stage 1 weight gradient, one part, one image"),
        (128, 363, 1152, "stage 2 forward, a group of 3 images"),
        (512, 261, 4608, "stage 4 forward, a group of 29 images"),
        (320, 256, 2880, "UNet 3x3 conv at 16 x 16, one image"),
        (64, 1024, 576, "bench UNet, 64 channels at 32 x 32"),
        (128, 256, 1152, "bench UNet, 128 channels at 16 x 16"),
        (256, 64, 2304, "bench UNet, 256 channels at 8 x 8"),
        (
            576,
            1024,
            64,
            "bench UNet 32 x 32: input gradient's columns",
        ),
        (512, 512, 2048, "large"),
    ] {
        println!(
            "| {m} x {n} x {k} | {what} | {:.0} | {:.0} | {:.0} |",
            gflops(m, n, k, Mode::One),
            gflops(m, n, k, Mode::GemmThreads),
            gflops(m, n, k, Mode::Blocks)
        );
    }
    println!("\nlinear layer forward, f32, ms (best of 3)\n");
    println!(
        "| rows x in -> out | what | `ft_kernels::linear::linear` | candle's `x.matmul(w.t())` |"
    );
    println!("|---|---|---|---|");
    for (rows, din, dout, what) in [
        (
            512,
            512,
            512,
            "T5 bench: attention's projections (8 x 64 tokens)",
        ),
        (512, 512, 2048, "T5 bench: feed-forward in"),
        (512, 2048, 512, "T5 bench: feed-forward out"),
        (
            256,
            512,
            512,
            "T5 bench: decoder's projections (8 x 32 tokens)",
        ),
    ] {
        let (ours, candle) = linear_ms(rows, din, dout)?;
        println!("| {rows} x {din} -> {dout} | {what} | {ours:.2} | {candle:.2} |");
    }
    Ok(())
}
