//! `cargo run --release -p ft-kernels --example time_gemm_shapes`: GFLOP/s of the `gemm` crate's
//! f32 product on one thread and on its own rayon threads, at the shapes the convolution runs
//! (an FSCT ResNet10 episode's layers, a part of a weight gradient, a UNet layer) and a large
//! one. The measurement behind `conv`'s choice of putting small products on rayon's threads one
//! each (`TASK_MACS`) rather than splitting each over gemm's threads.

use std::time::Instant;

/// GFLOP/s of `m x k` by `k x n` into `m x n` (row-major), best of three rounds of ~1 GFLOP.
fn gflops(m: usize, n: usize, k: usize, threads: bool) -> f64 {
    let a = vec![0.5f32; m * k];
    let b = vec![0.25f32; k * n];
    let mut c = vec![0f32; m * n];
    let reps = (1e9 / (2.0 * (m * n * k) as f64)).ceil() as usize;
    let parallelism = if threads {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    let mut run = || {
        // SAFETY: a, b and c hold m*k, k*n and m*n values, addressed with these row-major
        // strides; c does not alias a or b.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
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
                parallelism,
            )
        }
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

fn main() {
    ft_kernels::threads::settle();
    println!(
        "gemm f32, GFLOP/s (best of 3), {} rayon threads\n",
        rayon::current_num_threads()
    );
    println!("| m x n x k | what | one thread | gemm's threads |");
    println!("|---|---|---|---|");
    for (m, n, k, what) in [
        (64, 441, 576, "ResNet10 stage 1 forward, one image"),
        (64, 64, 441, "stage 1 weight gradient, one part, one image"),
        (128, 363, 1152, "stage 2 forward, a group of 3 images"),
        (512, 261, 4608, "stage 4 forward, a group of 29 images"),
        (320, 256, 2880, "UNet 3x3 conv at 16 x 16, one image"),
        (512, 512, 2048, "large"),
    ] {
        println!(
            "| {m} x {n} x {k} | {what} | {:.0} | {:.0} |",
            gflops(m, n, k, false),
            gflops(m, n, k, true)
        );
    }
}
