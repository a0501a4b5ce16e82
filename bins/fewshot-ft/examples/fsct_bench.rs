//! `cargo run --release -p fewshot-ft --example fsct_bench`: one training episode of FSCT_cosine
//! (forward, backward, AdamW; f32, CPU) on the Conv4 and ResNet10 backbones at 84 px, 5-way
//! 1-shot and 5-shot with 16 queries a class, next to PyTorch on the same shapes in the same run
//! (`scripts/fsct_bench_torch.py`, the model of `scripts/fsct_parity.py`; set `BENCH_PYTHON` to a
//! python with torch). Step time is the mean of `STEPS` episodes after a warm-up; peaks are the
//! resident set's above the level after the warm-up and above the level before it (both sides;
//! `StepMeasure::rss_from_start`, printed for the first row a process runs only: run one row a
//! process to compare it across rows; the one to compare, as ours keeps the warm-up's memory
//! mapped) and the exact heap's (ours).
//! `FSCT_BENCH_BACKBONE=resnet10` (or `conv4`) runs one backbone's rows, for a profiler;
//! `FSCT_BENCH_SHOTS=1` (or `5`) one shot count's; `FSCT_BENCH_CHECKPOINTING=blocks` (any
//! `--checkpointing` strategy; default `none`) runs ours under that strategy (PyTorch's side
//! stays without checkpointing).

use candle_core::{DType, Device, Tensor, Var};
use ft_models::fewshot::{Backbone, BackboneKind, Episode, FewShotModel, Method};
use ft_params::bytes::format_bytes;
use ft_params::checkpoint::{Checkpointer, Strategy};
use ft_params::{ParamBuilder, ParamStore};
use ft_trainer::train::bench::{
    bytes_or_dash, kept_line, measure_steps, minor_faults, python_reference, StepMeasure,
};

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

const STEPS: usize = 2;
const SIZE: usize = 84;
const N_WAY: usize = 5;
const N_QUERY: usize = 16;

/// Our episode: `kind` at 84 px, `k_shot` shots.
fn ours(kind: BackboneKind, k_shot: usize) -> anyhow::Result<StepMeasure> {
    let dev = Device::Cpu;
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 0);
    // Conv4 flattens its last map (as the torch side's does); ResNet10 averages it.
    let flatten = kind == BackboneKind::Conv4;
    let model = FewShotModel::new(
        &pb,
        Backbone::new(&pb, kind, SIZE, flatten)?,
        Method::FsctCosine,
        N_WAY,
        k_shot,
    )?;
    let mut opt = ft_trainer::train::bench::f32_adamw(&store)?;
    let params: Vec<Var> = opt.params().to_vec();
    let n = N_WAY * (k_shot + N_QUERY);
    let episode = Episode {
        images: Tensor::randn(0f32, 1., (n, 3, SIZE, SIZE), &dev)?,
        n_way: N_WAY,
        k_shot,
        n_query: N_QUERY,
    };
    // `FSCT_BENCH_CHECKPOINTING=blocks` (any `--checkpointing` strategy): ours under it.
    let strategy = match std::env::var("FSCT_BENCH_CHECKPOINTING") {
        Ok(s) => s.parse::<Strategy>().map_err(anyhow::Error::msg)?,
        Err(_) => Strategy::None,
    };
    let ck = Checkpointer::with_strategy(strategy);
    let queries = (N_WAY * N_QUERY) as f64;
    let m = measure_steps(STEPS, || -> anyhow::Result<()> {
        ck.begin_forward();
        let (loss, _) = model.summed_loss(&episode, true, &ck)?;
        let grads = ck.gradients(&(loss / queries)?, &params)?;
        opt.step(grads, 1e-3)?;
        Ok(())
    })?;
    // One more episode, timed by phase, with the exact heap above its level before it: what
    // the forward leaves live, and each phase's peak.
    use ft_trainer::ledger::alloc::{live_bytes, peak_bytes, reset_peak};
    ck.begin_forward();
    let base = live_bytes();
    reset_peak();
    let f0 = minor_faults();
    let t0 = std::time::Instant::now();
    let (loss, _) = model.summed_loss(&episode, true, &ck)?;
    let loss = (loss / queries)?;
    let t1 = std::time::Instant::now();
    let f1 = minor_faults();
    let (kept, fwd_peak) = (
        live_bytes().saturating_sub(base),
        peak_bytes().saturating_sub(base),
    );
    reset_peak();
    let grads = ck.gradients(&loss, &params)?;
    drop(loss);
    let t2 = std::time::Instant::now();
    let f2 = minor_faults();
    let bwd_peak = peak_bytes().saturating_sub(base);
    opt.step(grads, 1e-3)?;
    let t3 = std::time::Instant::now();
    eprintln!(
        "{kind:?} {k_shot}-shot, one more episode: forward {:.3} s (keeps {}, peak {}, {} minor \
         faults), backward {:.3} s (peak {}, {} minor faults), optimizer step {:.3} s",
        (t1 - t0).as_secs_f64(),
        format_bytes(kept as i64),
        format_bytes(fwd_peak as i64),
        f1 - f0,
        (t2 - t1).as_secs_f64(),
        format_bytes(bwd_peak as i64),
        f2 - f1,
        (t3 - t2).as_secs_f64()
    );
    Ok(m)
}

/// PyTorch's episode of the same shape, when a python with torch runs.
/// The PyTorch side's episode: mean time, resident peaks above the post-warm-up level and
/// above the level before the warm-up, torch's version.
struct Torch {
    step_s: f64,
    rss_peak: Option<u64>,
    rss_from_start: Option<u64>,
    rss_kept: Option<u64>,
    version: String,
}

fn torch(backbone: &str, k_shot: usize) -> Option<Torch> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/fsct_bench_torch.py"
    );
    let args = [
        ("--backbone", backbone.to_string()),
        ("--size", SIZE.to_string()),
        ("--n-way", N_WAY.to_string()),
        ("--k-shot", k_shot.to_string()),
        ("--n-query", N_QUERY.to_string()),
        ("--steps", STEPS.to_string()),
    ];
    let args: Vec<String> = args
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
    let v = python_reference(script, &args)?;
    if let Some(p) = v["phases_s"].as_array() {
        let p: Vec<f64> = p.iter().filter_map(|t| t.as_f64()).collect();
        if let [f, b, o] = p[..] {
            eprintln!(
                "PyTorch {backbone} {k_shot}-shot, one more episode: forward {f:.3} s, \
                 backward {b:.3} s, optimizer step {o:.3} s"
            );
        }
    }
    Some(Torch {
        step_s: v["step_time_s"].as_f64()?,
        rss_peak: v["rss_peak_above_base_bytes"].as_u64(),
        rss_from_start: v["rss_peak_above_start_bytes"].as_u64(),
        rss_kept: v["rss_kept_by_warm_up_bytes"].as_u64(),
        version: v["torch"].as_str().unwrap_or("?").to_string(),
    })
}

fn main() -> anyhow::Result<()> {
    // As the binaries do: candle's per-product thread count read once, not per product, and
    // the work on one of rayon's threads.
    ft_kernels::threads::run(bench)
}

fn bench() -> anyhow::Result<()> {
    println!(
        "FSCT_cosine training episode, {N_WAY}-way K-shot, {N_QUERY} queries a class, {SIZE} px, \
         f32, AdamW, CPU ({} threads); mean of {STEPS} episodes after a warm-up\n",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    println!(
        "| backbone | shots | ours | PyTorch | time ratio | peak RSS above post-warm-up: ours / PyTorch | peak RSS above start: ours / PyTorch | ours: peak heap (exact) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (kind, name) in [
        (BackboneKind::Conv4, "conv4"),
        (BackboneKind::ResNet10, "resnet10"),
    ] {
        if std::env::var("FSCT_BENCH_BACKBONE").is_ok_and(|only| only != name) {
            continue;
        }
        for k_shot in [1, 5] {
            if std::env::var("FSCT_BENCH_SHOTS").is_ok_and(|only| only != k_shot.to_string()) {
                continue;
            }
            let m = ours(kind, k_shot)?;
            let t = torch(name, k_shot);
            let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
                _ => "-".into(),
            };
            let t_start = t.as_ref().and_then(|t| t.rss_from_start);
            if let Some(line) = kept_line(m.rss_kept, t.as_ref().and_then(|t| t.rss_kept)) {
                eprintln!("{line}");
            }
            println!(
                "| {name} | {k_shot} | {:.3} s | {} | {} | {} / {} | {} / {} ({}) | {} |",
                m.step_s,
                t.as_ref()
                    .map(|t| format!("{:.3} s (torch {})", t.step_s, t.version))
                    .unwrap_or("-".into()),
                ratio(Some(m.step_s), t.as_ref().map(|t| t.step_s)),
                // No ratio: ours keeps what the warm-up mapped where PyTorch's glibc gives
                // much of it back (`StepMeasure::rss_peak`); the peak above start compares.
                bytes_or_dash(m.rss_peak),
                bytes_or_dash(t.as_ref().and_then(|t| t.rss_peak)),
                bytes_or_dash(m.rss_from_start),
                bytes_or_dash(t_start),
                ratio(
                    m.rss_from_start.map(|b| b as f64),
                    t_start.map(|b| b as f64)
                ),
                format_bytes(m.alloc_peak as i64),
            );
        }
    }
    Ok(())
}
