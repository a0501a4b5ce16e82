//! `cargo run --release -p ft-kernels --example time_sum_squares`: the gradient norm's sum of
//! squares on the CPU (`host::sum_squares`, eight f64 lanes a block) next to the same blocks
//! summed as one running f64 sum each (what it did before), at the T5 bench's 89.5M gradient
//! values; best of three, and both results.

use std::time::Instant;

use rayon::prelude::*;

fn main() -> candle_core::Result<()> {
    ft_kernels::threads::settle();
    let g = candle_core::Tensor::randn(0f32, 1., 89_500_000, &candle_core::Device::Cpu)?;
    let v: Vec<f32> = g.to_vec1()?;
    let best = |f: &dyn Fn() -> f64| {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                let s = f();
                (t.elapsed().as_secs_f64() * 1e3, s)
            })
            .fold((f64::MAX, 0.0), |a, b| if b.0 < a.0 { b } else { a })
    };
    let chain = best(&|| {
        let sums: Vec<f64> = v
            .par_chunks(ft_kernels::host::CHUNK)
            .map(|c| c.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>())
            .collect();
        sums.iter().sum()
    });
    let lanes = best(&|| ft_kernels::host::sum_squares(&g).unwrap_or(f64::NAN));
    println!("89.5M f32 values, {} threads", rayon::current_num_threads());
    println!("one running sum a block: {:.1} ms ({})", chain.0, chain.1);
    println!(
        "eight lanes a block (host::sum_squares): {:.1} ms ({})",
        lanes.0, lanes.1
    );
    Ok(())
}
