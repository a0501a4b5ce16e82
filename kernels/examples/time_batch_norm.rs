//! Times batch norm + ReLU + max pool on the CPU at the first block of fewshot-ft's Conv4
//! episode at 84 px (5-way 1-shot, 16 queries: 85 images of 64 channels, 2x2 pool) and at
//! ResNet10's stem of the same episode (42 px maps, 3x3 stride-2 pool, padding 1): one
//! forward, and one backward from the pooled output (which includes candle's backward of the
//! `mul` and `sum_all` that seed it, and its zeroed slot for the input's gradient). Checks the
//! op's output against the separate ops first.
//!
//! `cargo run --release -p ft-kernels --example time_batch_norm` (`FT_WIDE_SIMD=0` for the
//! baseline-compiled loops; `-- stem` or `-- conv4` for one shape)

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use ft_kernels::batch_norm_pool::{batch_norm_relu_max_pool_train, separate, MaxPool};

fn main() -> Result<()> {
    // An argument (`conv4` or `stem`) times one shape alone, for a profiler.
    let only = std::env::args().nth(1);
    if let Some(o) = only.as_deref().filter(|o| !["conv4", "stem"].contains(o)) {
        candle_core::bail!("time_batch_norm: unknown shape {o:?} (conv4 or stem)");
    }
    let run = |name: &str| only.as_deref().is_none_or(|o| o == name);
    if run("conv4") {
        time((85, 64, 84), MaxPool::square(2, 2, 0), "Conv4 block 1")?;
    }
    if run("stem") {
        time((85, 64, 42), MaxPool::square(3, 2, 1), "ResNet10 stem")?;
    }
    Ok(())
}

fn time((n, c, h): (usize, usize, usize), pool: MaxPool, what: &str) -> Result<()> {
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, c, h, h), &dev)?.affine(0.5, 0.1)?)?;
    let w = Var::from_tensor(&Tensor::randn(1f32, 0.1, c, &dev)?)?;
    let b = Var::from_tensor(&Tensor::randn(0f32, 0.1, c, &dev)?)?;
    let (y, _) = batch_norm_relu_max_pool_train(&x, &w, &b, 1e-5, pool)?;
    let (want, _) = separate(&x, &w, &b, 1e-5, pool)?;
    let diff = (y.to_dtype(DType::F64)? - want.to_dtype(DType::F64)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f64>()?;
    assert!(diff < 1e-5, "op and separate ops differ by {diff:e}");
    let g = y.ones_like()?;
    let reps = 5;
    let (mut fwd, mut bwd) = (0f64, 0f64);
    for _ in 0..=reps {
        let t = Instant::now();
        let (y, _) = batch_norm_relu_max_pool_train(&x, &w, &b, 1e-5, pool)?;
        let f = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let grads = (y * &g)?.sum_all()?.backward()?;
        let bk = t.elapsed().as_secs_f64();
        std::hint::black_box(grads.get(&x));
        fwd += f;
        bwd += bk;
    }
    // The first round warms the pages up; it is in the sums, as in a training loop's first step.
    let per = |s: f64| s / (reps + 1) as f64 * 1e3;
    println!(
        "{what}: batch norm + ReLU + max pool [{n}, {c}, {h}, {h}] f32 ({}): forward {:.1} ms, backward {:.1} ms",
        ft_kernels::wide::unit(),
        per(fwd),
        per(bwd)
    );
    Ok(())
}
