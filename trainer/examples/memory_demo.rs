//! A one-minute tour of the memory layer on CPU: a deep residual MLP stored in bf16 with fp32
//! master weights, trained with gradient accumulation, with and without gradient checkpointing,
//! every phase profiled by the ledger.
//!
//! `cargo run -p ft-trainer --example memory_demo` (a tour of the memory layer). Writes
//! `runs/memory-demo/{plain,checkpointed}/memory.jsonl` and prints a memory table per run.

use std::sync::Arc;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use ft_params::bytes::format_bytes;
use ft_params::checkpoint::{Checkpointer, SegmentFn};
use ft_params::{Init, ParamBuilder, ParamStore};
use ft_trainer::ledger::{Category, Ledger};
use ft_trainer::optim::{AdamW, AdamWConfig};
use ft_trainer::train::schedule::{LrSchedule, ScheduleKind};
use ft_trainer::update::{GradAccumulator, LossNorm, MixedOptimizer, Precision, StatePlacement};

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

const WIDTH: usize = 64;
const DEPTH: usize = 16;
const MICRO_BATCH: usize = 512;
const ACCUM: usize = 2;
const STEPS: u64 = 30;

struct Block {
    w1: Tensor,
    w2: Tensor,
    params: Vec<Var>,
}

/// `x + W2 gelu(W1 x)`: the residual MLP block of a transformer, without attention.
fn block_fn(b: &Block) -> SegmentFn {
    let (w1, w2) = (b.w1.clone(), b.w2.clone());
    Arc::new(move |xs: &[Tensor]| {
        let h = xs[0].matmul(&w1.t()?)?.gelu()?;
        &xs[0] + h.matmul(&w2.t()?)?
    })
}

struct Run {
    first_loss: f32,
    last_loss: f32,
    peak: u64,
    table: String,
}

fn train(checkpointing: bool, out_dir: &std::path::Path) -> Result<Run> {
    let dev = Device::Cpu;
    std::fs::create_dir_all(out_dir)?;
    let mut ledger = Ledger::new(&dev).with_timeline(out_dir.join("memory.jsonl"))?;
    ledger.set_baseline();

    let precision = Precision::parse("bf16")?;
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), precision.storage, &dev, 0);
    let std = (1.0 / WIDTH as f64).sqrt();
    let mut blocks = Vec::new();
    for i in 0..DEPTH {
        let p = pb.pp(format!("blocks.{i}"));
        let w1 = p.get(&[WIDTH * 2, WIDTH], "fc1.weight", Init::Normal { std })?;
        let w2 = p.get(
            &[WIDTH, WIDTH * 2],
            "fc2.weight",
            Init::Normal { std: std * 0.5 },
        )?;
        let params = vec![Var::from_tensor(&w1)?, Var::from_tensor(&w2)?];
        blocks.push(Block { w1, w2, params });
    }
    let params = store.trainable()?;
    let mut opt = MixedOptimizer::new(
        params,
        precision,
        StatePlacement::WithModel,
        |n| {
            Box::new(AdamW::new(
                n,
                AdamWConfig {
                    weight_decay: 0.0,
                    ..Default::default()
                },
            ))
        },
        Some(1.0),
    )?;
    let vars: Vec<Var> = opt.params().to_vec();
    opt.account(&mut ledger, "mlp");
    ledger.mark("load", 0)?;

    // A fixed random teacher defines the targets: y = tanh(x T).
    let teacher = Tensor::randn(0f32, 1.0 / (WIDTH as f32).sqrt(), (WIDTH, WIDTH), &dev)?;
    let schedule = LrSchedule {
        kind: ScheduleKind::Cosine,
        base_lr: 3e-3,
        warmup_steps: 4,
        total_steps: STEPS,
    };
    let ck = Checkpointer::new(checkpointing);
    let bar = indicatif::ProgressBar::new(STEPS);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} eta {eta}")?
            .progress_chars("=> "),
    );
    bar.set_prefix(if checkpointing {
        "checkpointed"
    } else {
        "plain       "
    });
    let (mut first_loss, mut last_loss) = (f32::NAN, f32::NAN);
    let norm = LossNorm::samples(&[MICRO_BATCH; ACCUM]);
    for step in 0..STEPS {
        let mut acc = GradAccumulator::new();
        let mut step_loss = 0f32;
        for _ in 0..ACCUM {
            let x = Tensor::randn(0f32, 1., (MICRO_BATCH, WIDTH), &dev)?;
            let y = x.matmul(&teacher)?.tanh()?;
            let mut h = x.to_dtype(precision.storage)?;
            for b in &blocks {
                h = ck.run(block_fn(b), &[&h], &b.params)?;
            }
            let summed = (h.to_dtype(DType::F32)? - y)?
                .sqr()?
                .sum_keepdim(1)?
                .sum_all()?;
            let loss = norm.scale(&summed)?;
            step_loss += loss.to_scalar::<f32>()? / WIDTH as f32;
            ledger.mark("forward", step)?;
            let grads = ck.gradients(&loss, &vars)?;
            drop(loss);
            acc.add(grads)?;
            ledger.set(Category::Gradients, "mlp", acc.bytes());
            ledger.mark("backward", step)?;
        }
        opt.step(acc.take(), schedule.lr_at(step))?;
        ledger.remove(Category::Gradients, "mlp");
        opt.account(&mut ledger, "mlp");
        ledger.mark("step", step)?;
        if step == 0 {
            first_loss = step_loss;
        }
        last_loss = step_loss;
        bar.set_message(format!(
            "loss {step_loss:.4} mem {}",
            format_bytes(ft_trainer::ledger::alloc::live_bytes() as i64)
        ));
        bar.inc(1);
    }
    bar.finish();
    Ok(Run {
        first_loss,
        last_loss,
        peak: ledger.peak().map(|(_, p)| p).unwrap_or(0),
        table: ledger.table(),
    })
}

fn main() -> Result<()> {
    let root = std::path::Path::new("runs/memory-demo");
    println!(
        "memory demo: {DEPTH}-block residual MLP (width {WIDTH}), bf16 weights + fp32 masters, \
         AdamW, accumulation {ACCUM} x {MICRO_BATCH}, {STEPS} steps\n"
    );
    let plain = train(false, &root.join("plain"))?;
    let ckpt = train(true, &root.join("checkpointed"))?;
    println!("\n== without checkpointing ==\n{}", plain.table);
    println!("== with checkpointing ==\n{}", ckpt.table);
    println!(
        "loss {:.4} -> {:.4} (plain), {:.4} -> {:.4} (checkpointed)",
        plain.first_loss, plain.last_loss, ckpt.first_loss, ckpt.last_loss
    );
    println!(
        "peak {} -> {} with checkpointing ({:.0}% less)",
        format_bytes(plain.peak as i64),
        format_bytes(ckpt.peak as i64),
        100.0 * (1.0 - ckpt.peak as f64 / plain.peak.max(1) as f64)
    );
    println!(
        "timelines: {}/{{plain,checkpointed}}/memory.jsonl",
        root.display()
    );
    Ok(())
}
