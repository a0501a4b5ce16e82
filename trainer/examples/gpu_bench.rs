//! `gpu_bench` : train steps of the full-size models on a GPU, one JSON line per measurement, for
//! `scripts/gpu-bench.sh` to set next to PyTorch's (`scripts/gpu_bench_torch.py`, run after this
//! process has exited so the two never share the card).
//!
//! ```text
//! gpu_bench sdxl <px>[,<px>...] [ck]      full SDXL UNet (configs/sdxl/unet_config.json), batch 1
//! gpu_bench t5 <batch> <src> <tgt> [ck]   FLAN-T5-XL shape (random weights from the real config)
//! gpu_bench attention [kernel-only]       attention kernels at SDXL and T5 shapes (kernel-only:
//!                                         skip the score-forming sdpa rows)
//! ```
//!
//! Model runs: bf16 weights, fp32 master weights, AdamW, one micro-batch per step; with
//! `FT_OFFLOAD=1` masters and moments live on the host (`StatePlacement::Host`); with
//! `FT_OPTIM=adamw8bit` the moments are 8-bit blocks (`ft_trainer::optim::adamw8bit`), with
//! `FT_OPTIM=adafactor` the state is Adafactor's, and with `FT_FULL_BF16=1` the bf16 weights
//! train without fp32 masters (`Precision::full_bf16`); with `FT_FUSED=1` (and `ck`) each
//! checkpointed block is updated during the backward (`MixedOptimizer::backward_and_step`,
//! kohya's fused backward pass). Memory comes
//! from the device's memory pool (exact bytes of live tensors and their peak, see
//! `ft_trainer::ledger::measure`): `base` is what stays allocated between steps (weights, masters, AdamW
//! moments), `peak` the highest allocation during the measured steps.

use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor, Var};
use ft_models::dropout::DropoutCtx;
use ft_models::t5::{T5Batch, T5Config, T5};
use ft_models::unet::{UNet, UNetConfig};
use ft_params::checkpoint::Checkpointer;
use ft_params::rng::SplitMix64;
use ft_params::{ParamBuilder, ParamStore};
use ft_trainer::ledger::measure;
use ft_trainer::optim::adafactor::{Adafactor, AdafactorConfig};
use ft_trainer::optim::adamw8bit::AdamW8bit;
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer};
use ft_trainer::update::{GradAccumulator, MixedOptimizer, Precision, StatePlacement};
use serde_json::json;

/// Whether `FT_OFFLOAD=1` asks for the optimizer state on the host.
fn offload() -> bool {
    std::env::var("FT_OFFLOAD").is_ok_and(|v| v == "1")
}

/// `FT_OPTIM`: adamw (default), adamw8bit or adafactor.
fn optim() -> String {
    std::env::var("FT_OPTIM").unwrap_or_else(|_| "adamw".into())
}

/// Whether `FT_FULL_BF16=1` asks for bf16 weights without masters.
fn full_bf16() -> bool {
    std::env::var("FT_FULL_BF16").is_ok_and(|v| v == "1")
}

/// Whether `FT_FUSED=1` asks for the fused backward pass.
fn fused() -> bool {
    std::env::var("FT_FUSED").is_ok_and(|v| v == "1")
}

/// The run's label: `candle`, then `-ops` with `FT_CUDA_KERNELS=0` (candle's own ops in place
/// of this project's kernels), `-offload` with `FT_OFFLOAD=1`, `-full-bf16` with
/// `FT_FULL_BF16=1`, `-8bit` or `-adafactor` for `FT_OPTIM`, and `-fused` with `FT_FUSED=1`.
fn label() -> String {
    let mut l = String::from("candle");
    #[cfg(feature = "cuda")]
    if !ft_kernels::cuda::enabled() {
        l.push_str("-ops");
    }
    if offload() {
        l.push_str("-offload");
    }
    if full_bf16() {
        l.push_str("-full-bf16");
    }
    match optim().as_str() {
        "adamw8bit" => l.push_str("-8bit"),
        "adafactor" => l.push_str("-adafactor"),
        _ => {}
    }
    if fused() {
        l.push_str("-fused");
    }
    l
}

const WARMUP: usize = 1;
const STEPS: usize = 3;

fn device() -> anyhow::Result<Device> {
    let d = Device::new_cuda(0)
        .context("gpu_bench needs a CUDA device (build with --features cuda)")?;
    Ok(d)
}

fn sync(dev: &Device) -> anyhow::Result<()> {
    dev.synchronize()?;
    Ok(())
}

/// Per-step time of forward, backward (with the recomputation under checkpointing) and the
/// optimizer step, each ended by a device sync: where a step's time goes.
#[derive(Default)]
struct Phases {
    rows: std::cell::RefCell<Vec<[f64; 3]>>,
}

impl Phases {
    /// Runs one step as its three phases, recording each one's time.
    fn step<L, G>(
        &self,
        dev: &Device,
        forward: impl FnOnce() -> anyhow::Result<L>,
        backward: impl FnOnce(L) -> anyhow::Result<G>,
        update: impl FnOnce(G) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let t = Instant::now();
        let loss = forward()?;
        sync(dev)?;
        let f = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let grads = backward(loss)?;
        sync(dev)?;
        let b = t.elapsed().as_secs_f64();
        let t = Instant::now();
        update(grads)?;
        sync(dev)?;
        self.rows
            .borrow_mut()
            .push([f, b, t.elapsed().as_secs_f64()]);
        Ok(())
    }

    /// Mean seconds of each phase over the last `STEPS` steps.
    fn json(&self) -> serde_json::Value {
        let rows = self.rows.borrow();
        let last = &rows[rows.len().saturating_sub(STEPS)..];
        let mean = |i: usize| last.iter().map(|r| r[i]).sum::<f64>() / last.len().max(1) as f64;
        json!({"forward_s": mean(0), "backward_s": mean(1), "optimizer_s": mean(2)})
    }
}

const LR: f64 = 1e-5;

/// One measured train step from `forward`'s loss: the gradients, then the optimizer's step; or
/// with `FT_FUSED=1` the fused backward pass, which updates during the backward (its update
/// phase is then empty).
fn train_step(
    phases: &Phases,
    dev: &Device,
    checkpointer: &Checkpointer,
    params: &[Var],
    opt: &std::cell::RefCell<MixedOptimizer>,
    forward: impl FnOnce() -> anyhow::Result<Tensor>,
) -> anyhow::Result<()> {
    let fused = fused();
    if fused {
        checkpointer.begin_forward();
    }
    phases.step(
        dev,
        forward,
        |loss| {
            Ok(if fused {
                opt.borrow_mut().backward_and_step(
                    checkpointer,
                    &loss,
                    LR,
                    &mut GradAccumulator::new(),
                )?;
                None
            } else {
                Some(checkpointer.gradients(&loss, params)?)
            })
        },
        |grads| {
            if let Some(grads) = grads {
                opt.borrow_mut().step(grads, LR)?;
            }
            Ok(())
        },
    )
}

/// A model's checkpointer, refusing `FT_FUSED=1` without checkpointing (it updates as
/// checkpointed blocks are recomputed).
fn checkpointer(ck: bool) -> anyhow::Result<Checkpointer> {
    if fused() && !ck {
        bail!("FT_FUSED=1 needs checkpointing (the `ck` argument)");
    }
    Ok(Checkpointer::new(ck))
}

fn randn(rng: &mut SplitMix64, shape: &[usize], dt: DType, dev: &Device) -> anyhow::Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    Ok(Tensor::from_vec(v, shape, dev)?.to_dtype(dt)?)
}

fn optimizer(store: &ParamStore) -> anyhow::Result<MixedOptimizer> {
    let cfg = AdamWConfig::default();
    let precision = if full_bf16() {
        Precision::full_bf16()
    } else {
        Precision::parse("bf16")?
    };
    let kind = optim();
    Ok(MixedOptimizer::new(
        store.trainable()?,
        precision,
        StatePlacement::offload(offload()),
        |n| -> Box<dyn Optimizer> {
            match kind.as_str() {
                "adamw8bit" => Box::new(AdamW8bit::new(n, cfg)),
                "adafactor" => Box::new(Adafactor::new(n, AdafactorConfig::trainer(0.0))),
                _ => Box::new(AdamW::new(n, cfg)),
            }
        },
        None,
    )?)
}

/// Warm-up, then the measured steps; returns (mean step seconds, base bytes, peak bytes).
fn measure_steps(
    dev: &Device,
    mut step: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<(f64, u64, u64)> {
    for _ in 0..WARMUP {
        step()?;
    }
    sync(dev)?;
    let base = measure::read(dev).live;
    let t0 = Instant::now();
    for _ in 0..STEPS {
        step()?;
    }
    sync(dev)?;
    let secs = t0.elapsed().as_secs_f64() / STEPS as f64;
    let peak = measure::read(dev).peak;
    Ok((secs, base, peak))
}

fn states(store: &ParamStore, opt: &MixedOptimizer) -> serde_json::Value {
    let (n, weight_bytes) = store.count(true);
    let master: u64 = opt
        .masters()
        .iter()
        .map(|m| ft_params::bytes::tensor_bytes(m.as_tensor()))
        .sum();
    json!({
        "params": n,
        "weights": weight_bytes,
        "grads": weight_bytes,
        "masters": master,
        "optimizer": opt.optimizer().state_bytes(),
    })
}

fn sdxl(pxs: &[usize], ck: bool) -> anyhow::Result<()> {
    let dev = device()?;
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sdxl/unet_config.json");
    let cfg = UNetConfig::from_file(&path)?;
    let t0 = Instant::now();
    let store = ParamStore::new();
    let unet = UNet::new(
        &ParamBuilder::new(store.clone(), DType::BF16, &dev, 0),
        &cfg,
    )?;
    let opt = std::cell::RefCell::new(optimizer(&store)?);
    eprintln!("sdxl: model built in {:.1} s", t0.elapsed().as_secs_f64());
    let params: Vec<Var> = opt.borrow().params().to_vec();
    let pooled_dim = cfg
        .projection_class_embeddings_input_dim
        .context("SDXL config has projection_class_embeddings_input_dim")?
        - 6 * cfg.addition_time_embed_dim.unwrap_or(256);
    let checkpointer = checkpointer(ck)?;
    for &px in pxs {
        let latent = px / 8;
        let mut rng = SplitMix64::new(px as u64);
        let bf = DType::BF16;
        let x = randn(&mut rng, &[1, 4, latent, latent], bf, &dev)?;
        let target = randn(&mut rng, &[1, 4, latent, latent], DType::F32, &dev)?;
        let ctx = randn(&mut rng, &[1, 77, cfg.cross_attention_dim], bf, &dev)?;
        let pooled = randn(&mut rng, &[1, pooled_dim], bf, &dev)?;
        let p = px as f32;
        let ids = Tensor::new(&[[p, p, 0.0, 0.0, p, p]], &dev)?.to_dtype(bf)?;
        let phases = Phases::default();
        let mut step = || -> anyhow::Result<()> {
            train_step(&phases, &dev, &checkpointer, &params, &opt, || {
                let pred =
                    unet.forward(&x, &[500.0], &ctx, Some((&pooled, &ids)), &checkpointer)?;
                Ok((pred.to_dtype(DType::F32)? - &target)?.sqr()?.mean_all()?)
            })
        };
        let (secs, base, peak) = measure_steps(&dev, &mut step)?;
        println!(
            "{}",
            json!({"bench": "sdxl", "impl": label(), "px": px, "checkpointing": ck,
                   "step_s": secs, "base": base, "peak": peak,
                   "states": states(&store, &opt.borrow()), "phases": phases.json()})
        );
    }
    Ok(())
}

fn flan_t5_xl() -> anyhow::Result<T5Config> {
    Ok(serde_json::from_str(
        r#"{"d_ff": 5120, "d_kv": 64, "d_model": 2048, "num_heads": 32, "num_layers": 24,
            "num_decoder_layers": 24, "feed_forward_proj": "gated-gelu",
            "tie_word_embeddings": false, "vocab_size": 32128,
            "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
            "dropout_rate": 0.0, "layer_norm_epsilon": 1e-6}"#,
    )?)
}

fn t5(batch: usize, src: usize, tgt: usize, ck: bool) -> anyhow::Result<()> {
    let dev = device()?;
    let cfg = flan_t5_xl()?;
    let t0 = Instant::now();
    let store = ParamStore::new();
    let model = T5::new(
        &ParamBuilder::new(store.clone(), DType::BF16, &dev, 0),
        &cfg,
    )?;
    let opt = std::cell::RefCell::new(optimizer(&store)?);
    eprintln!("t5: model built in {:.1} s", t0.elapsed().as_secs_f64());
    let params: Vec<Var> = opt.borrow().params().to_vec();
    let mut rng = SplitMix64::new(7);
    let mut ids = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| 2 + rng.below(cfg.vocab_size - 2) as u32)
            .collect()
    };
    let b = T5Batch {
        input_ids: Tensor::from_vec(ids(batch * src), (batch, src), &dev)?,
        attention_mask: Tensor::ones((batch, src), DType::F32, &dev)?,
        labels: Tensor::from_vec(ids(batch * tgt), (batch, tgt), &dev)?.to_dtype(DType::I64)?,
        label_tokens: batch * tgt,
    };
    let checkpointer = checkpointer(ck)?;
    let phases = Phases::default();
    let mut step = || -> anyhow::Result<()> {
        train_step(&phases, &dev, &checkpointer, &params, &opt, || {
            let sum = model.summed_loss(&b, &DropoutCtx::eval(), &checkpointer)?;
            Ok((sum / (batch * tgt) as f64)?)
        })
    };
    let (secs, base, peak) = measure_steps(&dev, &mut step)?;
    println!(
        "{}",
        json!({"bench": "t5", "impl": label(), "batch": batch, "src": src, "tgt": tgt,
               "checkpointing": ck, "step_s": secs, "base": base, "peak": peak,
               "states": states(&store, &opt.borrow()), "phases": phases.json()})
    );
    Ok(())
}

/// Forward + backward of one attention call; (mean seconds, peak bytes above the inputs).
fn time_attention(
    dev: &Device,
    f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
    q: &Var,
    k: &Var,
    v: &Var,
    g: &Tensor,
) -> anyhow::Result<(f64, u64)> {
    let run = || -> anyhow::Result<()> {
        let o = f(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
        let loss = (o.to_dtype(DType::F32)? * g)?.sum_all()?;
        let grads = loss.backward()?;
        for t in [q, k, v] {
            grads
                .get(t.as_tensor())
                .context("attention input has no gradient")?;
        }
        Ok(())
    };
    run()?;
    sync(dev)?;
    let reps = 10;
    let base = measure::read(dev).live;
    let t0 = Instant::now();
    for _ in 0..reps {
        run()?;
    }
    sync(dev)?;
    let secs = t0.elapsed().as_secs_f64() / reps as f64;
    let peak = measure::read(dev).peak;
    Ok((secs, peak.saturating_sub(base)))
}

/// The memory-efficient kernel's label: in bf16 it runs on tensor cores (forward and backward) unless
/// `FT_ATTENTION_TC=0`.
fn kernel_label() -> &'static str {
    #[cfg(feature = "cuda")]
    if !ft_kernels::cuda::tensor_cores_enabled() {
        return "memory-efficient kernel (CUDA cores)";
    }
    "memory-efficient kernel (tensor cores)"
}

fn attention(kernel_only: bool) -> anyhow::Result<()> {
    use ft_kernels::attention::{sdpa, sdpa_memory_efficient};
    let dev = device()?;
    // (label, batch, heads, query tokens, key tokens)
    let shapes = [
        ("sdxl-1024px-self", 1usize, 10usize, 4096usize, 4096usize),
        ("sdxl-1024px-cross", 1, 10, 4096, 77),
        ("sdxl-128px-self", 1, 10, 256, 256),
        ("t5-xl-b8-512", 8, 32, 512, 512),
    ];
    let mut rng = SplitMix64::new(3);
    for (label, b, h, lq, lk) in shapes {
        let d = 64usize;
        let mk = |rng: &mut SplitMix64, l: usize| -> anyhow::Result<Var> {
            Ok(Var::from_tensor(&randn(
                rng,
                &[b, h, l, d],
                DType::BF16,
                &dev,
            )?)?)
        };
        let (q, k, v) = (mk(&mut rng, lq)?, mk(&mut rng, lk)?, mk(&mut rng, lk)?);
        let g = randn(&mut rng, &[b, h, lq, d], DType::F32, &dev)?;
        let scale = (d as f64).powf(-0.5);
        let full = |q: &Tensor, k: &Tensor, v: &Tensor| sdpa(q, k, v, None, scale);
        let chunked =
            |q: &Tensor, k: &Tensor, v: &Tensor| sdpa_memory_efficient(q, k, v, None, scale, 64);
        for (name, f) in [
            (
                "sdpa (scores formed)",
                &full as &dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
            ),
            (kernel_label(), &chunked),
        ] {
            if kernel_only && name.starts_with("sdpa") {
                continue;
            }
            let r = time_attention(&dev, f, &q, &k, &v, &g);
            let v = match r {
                Ok((secs, peak)) => json!({"fwd_bwd_s": secs, "peak_above_inputs": peak}),
                Err(e) => json!({"error": e.to_string()}),
            };
            println!(
                "{}",
                json!({"bench": "attention", "impl": name, "shape": label, "b": b, "h": h,
                       "lq": lq, "lk": lk, "d": d, "result": v})
            );
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ck = args.iter().any(|a| a == "ck");
    let num = |i: usize| -> anyhow::Result<usize> {
        args.get(i)
            .context("missing argument (see the doc comment)")?
            .parse()
            .with_context(|| format!("argument {i} is not a number"))
    };
    match args.first().map(String::as_str) {
        Some("sdxl") => {
            let pxs = args
                .get(1)
                .context("gpu_bench sdxl <px>[,<px>...] [ck]")?
                .split(',')
                .map(|p| p.parse::<usize>().context("px is not a number"))
                .collect::<anyhow::Result<Vec<_>>>()?;
            sdxl(&pxs, ck)
        }
        Some("t5") => t5(num(1)?, num(2)?, num(3)?, ck),
        Some("attention") => attention(args.get(1).is_some_and(|a| a == "kernel-only")),
        _ => bail!(
            "usage: gpu_bench sdxl <px>[,<px>...] [ck] | t5 <batch> <src> <tgt> [ck] | attention"
        ),
    }
}
