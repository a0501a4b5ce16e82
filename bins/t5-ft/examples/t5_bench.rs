//! `cargo run -p t5-ft --example t5_bench` : train-step time and peak memory of a t5-small-sized
//! model on CPU with and without checkpointing, next to PyTorch + transformers in the same run
//! (when `python3` with torch and transformers is found; set `BENCH_PYTHON` to choose one), a
//! FLAN-T5-XL memory plan from its real config, and data-pipeline throughput.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use ft_models::dropout::DropoutCtx;
use ft_models::t5::{T5Batch, T5Config, T5};
use ft_params::bytes::format_bytes;
use ft_params::checkpoint::{Checkpointer, Strategy};
use ft_params::rng::SplitMix64;
use ft_params::{ParamBuilder, ParamStore};
use ft_trainer::train::bench::bytes_or_dash;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

const BATCH: usize = 8;
const SRC: usize = 64;
const TGT: usize = 32;
const STEPS: usize = 3;

fn small() -> T5Config {
    let mut c = T5Config::tiny(32128);
    c.d_model = 512;
    c.d_kv = 64;
    c.d_ff = 2048;
    c.num_layers = 6;
    c.num_decoder_layers = Some(6);
    c.num_heads = 8;
    c.relative_attention_num_buckets = 32;
    c.relative_attention_max_distance = 128;
    c
}

struct Row {
    name: String,
    step_s: f64,
    alloc_peak: Option<u64>,
    rss_peak: Option<u64>,
    rss_from_start: Option<u64>,
    told: Option<(u64, u64, u64)>,
}

fn ours(strategy: Strategy) -> anyhow::Result<Row> {
    let dev = Device::Cpu;
    let cfg = small();
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 0);
    let model = T5::new(&pb, &cfg)?;
    let mut opt = ft_trainer::train::bench::f32_adamw(&store)?;
    let params: Vec<Var> = opt.params().to_vec();
    let mut rng = SplitMix64::new(1);
    let mut ids = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| 2 + rng.below(cfg.vocab_size - 2) as u32)
            .collect()
    };
    let batch = T5Batch {
        input_ids: Tensor::from_vec(ids(BATCH * SRC), (BATCH, SRC), &dev)?,
        attention_mask: Tensor::ones((BATCH, SRC), DType::F32, &dev)?,
        labels: Tensor::from_vec(ids(BATCH * TGT), (BATCH, TGT), &dev)?.to_dtype(DType::I64)?,
        label_tokens: BATCH * TGT,
    };
    let ck = Checkpointer::with_strategy(strategy);
    let mut step = || -> anyhow::Result<()> {
        ck.begin_forward();
        let loss = (model.summed_loss(&batch, &DropoutCtx::eval(), &ck)? / (BATCH * TGT) as f64)?;
        let grads = ck.gradients(&loss, &params)?;
        drop(loss);
        opt.step(grads, 1e-4)?;
        Ok(())
    };
    let m = ft_trainer::train::bench::measure_steps(STEPS, &mut step)?;
    // One more step, probed: where in the step the heap peaks (exact bytes above its start).
    {
        use ft_trainer::ledger::alloc;
        use std::sync::{Arc, Mutex};
        let mib = |b: usize| b >> 20;
        ck.begin_forward();
        let b0 = alloc::live_bytes();
        let t0 = Instant::now();
        let loss = (model.summed_loss(&batch, &DropoutCtx::eval(), &ck)? / (BATCH * TGT) as f64)?;
        let t_forward = t0.elapsed().as_secs_f64();
        let end_forward = alloc::live_bytes().saturating_sub(b0);
        alloc::reset_peak();
        // At each segment's end: (peak since the previous one, live now), in MiB.
        let probes: Arc<Mutex<Vec<(usize, usize)>>> = Arc::default();
        let seen = probes.clone();
        let hook: ft_params::checkpoint::EarlyStep = Arc::new(move |g| {
            let (live, peak) = (alloc::live_bytes(), alloc::peak_bytes());
            if let Ok(mut p) = seen.lock() {
                p.push((mib(peak.saturating_sub(b0)), mib(live.saturating_sub(b0))));
            }
            alloc::reset_peak();
            Ok(g) // takes nothing: a probe
        });
        let t1 = Instant::now();
        let (grads, _) = ck.gradients_with(&loss, &params, Some(hook))?;
        let t_backward = t1.elapsed().as_secs_f64();
        let tail = alloc::peak_bytes().saturating_sub(b0);
        drop(loss);
        alloc::reset_peak();
        let t2 = Instant::now();
        opt.step(grads, 1e-4)?;
        let t_step = t2.elapsed().as_secs_f64();
        let step_peak = alloc::peak_bytes().saturating_sub(b0);
        let probes = probes.lock().map(|p| p.clone()).unwrap_or_default();
        eprintln!(
            "--checkpointing {strategy}, heap above the step's start (MiB): end of forward {}; \
             at each segment's end in backward (peak since the last, live): {probes:?}; \
             backward peak after the last segment {}; optimizer step peak {}; time: forward \
             {t_forward:.3} s, backward {t_backward:.3} s, optimizer step {t_step:.3} s",
            mib(end_forward),
            mib(tail),
            mib(step_peak)
        );
    }
    let (_, pbytes) = store.count(true);
    let state = opt.optimizer().state_bytes();
    Ok(Row {
        name: format!("candle (this repo), --checkpointing {strategy}"),
        step_s: m.step_s,
        alloc_peak: Some(m.alloc_peak),
        rss_peak: m.rss_peak,
        rss_from_start: m.rss_from_start,
        told: Some((pbytes, pbytes, state)),
    })
}

/// PyTorch's row; `flush` runs it with `torch.set_flush_denormal(True)` (subnormals as zero).
fn torch(checkpointing: bool, flush: bool) -> Option<Row> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/t5_bench_torch.py"
    );
    let v = ft_trainer::train::bench::python_reference(
        script,
        &[
            "--steps".into(),
            STEPS.to_string(),
            "--checkpointing".into(),
            if checkpointing { "1" } else { "0" }.into(),
            "--flush-denormal".into(),
            if flush { "1" } else { "0" }.into(),
        ],
    )?;
    Some(Row {
        name: format!(
            "PyTorch {} + transformers{}",
            v["torch"].as_str().unwrap_or("?"),
            if checkpointing { ", checkpointing" } else { "" }
        ) + if flush {
            ", set_flush_denormal(True)"
        } else {
            ""
        },
        step_s: v["step_time_s"].as_f64()?,
        alloc_peak: None,
        rss_peak: v["rss_peak_above_base_bytes"].as_u64(),
        rss_from_start: v["rss_peak_above_start_bytes"].as_u64(),
        told: None,
    })
}

fn data_throughput() -> anyhow::Result<(usize, f64)> {
    let dir = std::env::temp_dir().join(format!("t5-bench-data-{}", std::process::id()));
    t5_ft::demo::write(&dir, 20_000, 1, 3)?;
    let fields = t5_ft::data::Fields {
        input: "input".into(),
        target: "target".into(),
        skip_bad: false,
    };
    let t0 = Instant::now();
    let file = t5_ft::data::RecordFile::open(&dir.join("train.jsonl"), fields)?;
    let coll =
        t5_ft::tokenize::Collator::from_file(&dir.join("model/tokenizer.json"), 64, 32, 0, 32)?;
    let order = ft_trainer::train::EpochOrder {
        items: file.len(),
        batch_size: 64,
        seed: 0,
        shuffle: true,
        grouping: ft_trainer::train::Grouping::None,
    };
    for b in order.batches(0) {
        coll.collate(&file.read(&b)?, &Device::Cpu)?;
    }
    let n = file.len();
    let secs = t0.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&dir).ok();
    Ok((n, n as f64 / secs))
}

fn main() -> anyhow::Result<()> {
    // As the binaries do: candle's per-product thread count read once, not per product, and
    // the work on one of rayon's threads.
    ft_kernels::threads::run(bench)
}

fn bench() -> anyhow::Result<()> {
    let cfg = small();
    println!(
        "t5-small-sized train step on CPU ({} threads): d_model 512, 6+6 layers, 8 heads, vocab 32128, \
         batch {BATCH}, source {SRC} / target {TGT} tokens, f32, AdamW; mean of {STEPS} steps after a warm-up\n\
         ({} parameters)\n",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        cfg.param_count()
    );
    println!(
        "| run | step time | ratio to PyTorch | peak RSS above post-warm-up | peak RSS above start | peak heap above (exact) | params | grads | optimizer |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut measured = Vec::new();
    // Ratios to PyTorch's plain step, and for `full` to its torch.utils.checkpoint step; each
    // PyTorch row printed after the first strategy compared with it.
    let (t_plain, t_ckpt) = (torch(false, false), torch(true, false));
    // PyTorch once more with subnormals flushed: the head's tiny probabilities are subnormal
    // floats at this initialisation, which x86 multiplies slowly unless told to flush them;
    // this side flushes only those (in its cross-entropy and softmax), PyTorch can flush all.
    let t_flush = torch(false, true);
    let strategies = [
        Strategy::None,
        Strategy::Blocks,
        Strategy::Every(2),
        Strategy::Full,
    ];
    for strategy in strategies {
        let r = ours(strategy)?;
        let t = if strategy == Strategy::Full {
            &t_ckpt
        } else {
            &t_plain
        };
        let ratio = t
            .as_ref()
            .map(|t| format!("{:.2}x", r.step_s / t.step_s))
            .unwrap_or("-".into());
        let (p, g, o) = r.told.unwrap_or_default();
        println!(
            "| {} | {:.3} s | {ratio} | {} | {} | {} | {} | {} | {} |",
            r.name,
            r.step_s,
            bytes_or_dash(r.rss_peak),
            bytes_or_dash(r.rss_from_start),
            bytes_or_dash(r.alloc_peak),
            format_bytes(p as i64),
            format_bytes(g as i64),
            format_bytes(o as i64)
        );
        let first = matches!(strategy, Strategy::None | Strategy::Full);
        if let (Some(t), true) = (t, first) {
            println!(
                "| {} | {:.3} s | 1.00x | {} | {} | - | - | - | - |",
                t.name,
                t.step_s,
                bytes_or_dash(t.rss_peak),
                bytes_or_dash(t.rss_from_start)
            );
        }
        if first {
            measured.push(r);
        }
    }
    if let Some(t) = &t_flush {
        println!(
            "| {} | {:.3} s | ({:.2}x for ours, --checkpointing none) | {} | {} | - | - | - | - |",
            t.name,
            t.step_s,
            measured.first().map_or(f64::NAN, |r| r.step_s / t.step_s),
            bytes_or_dash(t.rss_peak),
            bytes_or_dash(t.rss_from_start)
        );
    }

    // FLAN-T5-XL from its real config: exact model states, activations scaled from t5-small.
    let xl: T5Config = serde_json::from_str(
        r#"{"d_ff": 5120, "d_kv": 64, "d_model": 2048, "num_heads": 32, "num_layers": 24,
            "feed_forward_proj": "gated-gelu", "tie_word_embeddings": false, "vocab_size": 32128}"#,
    )?;
    let n = xl.param_count() as u64;
    println!("\nFLAN-T5-XL ({n} parameters), bf16 weights with fp32 master weights and AdamW:\n");
    print!("{}", ft_trainer::train::bench::model_states_table(n));
    println!("\n| activations | bytes |\n|---|---|");
    let tokens_small = (BATCH * (SRC + TGT)) as f64;
    let scale = (xl.num_layers * (xl.d_model + xl.d_ff)) as f64
        / (cfg.num_layers * (cfg.d_model + cfg.d_ff)) as f64;
    for (label, r) in ["without checkpointing", "with checkpointing"]
        .iter()
        .zip(&measured)
    {
        let (p, g, o) = r.told.unwrap_or_default();
        let act = r.alloc_peak.unwrap_or(0).saturating_sub(g) as f64;
        let _ = (p, o);
        let per_token_xl = act / tokens_small * scale * 0.5; // f32 measured, bf16 planned
        let tokens_xl = 8.0 * (512.0 + 128.0);
        println!(
            "| activations, batch 8 x (512 + 128) tokens, {label} (scaled estimate) | {} |",
            format_bytes((per_token_xl * tokens_xl) as i64)
        );
    }
    let (lines, rate) = data_throughput()?;
    println!("\ndata pipeline (index + read + tokenize + pad, word-level demo tokenizer): {lines} records at {rate:.0} records/s");
    Ok(())
}
