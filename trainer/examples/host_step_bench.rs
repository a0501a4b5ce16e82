//! `cargo run --release -p ft-trainer --example host_step_bench [millions of parameters]
//! [adamw|adamw8bit]`: what
//! an offloaded optimizer (`StatePlacement::Host`, `--offload-optimizer`) costs the host: adding
//! one micro-batch's bf16 gradients into the fp32 sums, and the step (clipping, AdamW on fp32
//! masters and moments, the rounded bf16 weights written back). `FT_HOST_ADAMW=0` runs the
//! step's AdamW op by op instead of in one threaded pass, for comparison.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use ft_trainer::optim::adamw8bit::AdamW8bit;
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer};
use ft_trainer::update::{GradAccumulator, MixedOptimizer, Precision, StatePlacement};

const TENSORS: usize = 8;
const STEPS: usize = 3;

fn main() -> anyhow::Result<()> {
    let millions: usize = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 32,
    };
    let n = (millions << 20) / TENSORS;
    let params = (0..TENSORS)
        .map(|i| {
            let w = Tensor::ones(n, DType::BF16, &Device::Cpu)?;
            Ok((format!("p{i}"), Var::from_tensor(&w)?))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let eight_bit = std::env::args().nth(2).as_deref() == Some("adamw8bit");
    let cfg = AdamWConfig::default();
    let mut opt = MixedOptimizer::new(
        params,
        Precision::parse("bf16")?,
        StatePlacement::Host,
        |n| -> Box<dyn Optimizer> {
            if eight_bit {
                Box::new(AdamW8bit::new(n, cfg))
            } else {
                Box::new(AdamW::new(n, cfg))
            }
        },
        Some(1.0),
    )?;
    let grads = || -> anyhow::Result<Vec<Option<Tensor>>> {
        (0..TENSORS)
            .map(|_| {
                Ok(Some(
                    Tensor::full(0.01f32, n, &Device::Cpu)?.to_dtype(DType::BF16)?,
                ))
            })
            .collect()
    };
    let (mut add_s, mut step_s) = (Vec::new(), Vec::new());
    // A warm-up step first: it creates the moments.
    for _ in 0..=STEPS {
        let mut acc = GradAccumulator::on(&Device::Cpu);
        acc.add(grads()?)?;
        let g = grads()?;
        let t = Instant::now();
        acc.add(g)?;
        add_s.push(t.elapsed().as_secs_f64());
        let sums = acc.take();
        let t = Instant::now();
        opt.step(sums, 1e-3)?;
        step_s.push(t.elapsed().as_secs_f64());
    }
    let mean = |v: &[f64]| v[1..].iter().sum::<f64>() / STEPS as f64;
    let adamw = match std::env::var("FT_HOST_ADAMW").as_deref() {
        _ if eight_bit => "with 8-bit moments (adamw8bit)",
        Ok("0") => "op by op (FT_HOST_ADAMW=0)",
        _ => "one threaded pass",
    };
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let params = n * TENSORS;
    println!(
        "{}M parameters, {threads} threads, optimizer state {:.2} bytes per parameter",
        params >> 20,
        opt.optimizer().state_bytes() as f64 / params as f64
    );
    println!("| host work | time | per parameter |");
    println!("|---|---|---|");
    for (what, s) in [
        (
            "add a micro-batch's bf16 gradients into the fp32 sums",
            mean(&add_s),
        ),
        (&format!("optimizer step, AdamW {adamw}")[..], mean(&step_s)),
    ] {
        println!("| {what} | {s:.3} s | {:.1} ns |", s * 1e9 / params as f64);
    }
    Ok(())
}
