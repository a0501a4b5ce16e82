//! `cargo run --release -p fewshot-ft --example fsct_phases`: FSCT_cosine training episodes at
//! 84 px (5-way 1-shot, 16 queries a class; ResNet10, or Conv4 with `FSCT_PHASES_BACKBONE=conv4`),
//! each phase timed, with the process asleep 0.2 s between the forward and the backward and
//! 0.4 s after the optimizer step: a profiler's samples then split into phases by their gaps
//! (`scripts/perf_phases.py`), every thread's counted, where `perf_share.py` can only count
//! the samples whose chain reaches the timed steps. `FSCT_PHASES_EPISODES` episodes (default 6).
//!
//! `perf record -F 999 --call-graph dwarf,16384 -o phases.perf target/release/examples/fsct_phases`
//! (a build with line tables: docs/benchmarks.md), then
//! `perf script -i phases.perf | python3 scripts/perf_phases.py backward`.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
use ft_models::fewshot::{Backbone, BackboneKind, Episode, FewShotModel, Method};
use ft_params::checkpoint::{Checkpointer, Strategy};
use ft_params::{ParamBuilder, ParamStore};

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

const SIZE: usize = 84;
const N_WAY: usize = 5;
const K_SHOT: usize = 1;
const N_QUERY: usize = 16;

fn main() -> anyhow::Result<()> {
    ft_kernels::threads::run(phases)
}

fn phases() -> anyhow::Result<()> {
    let kind = match std::env::var("FSCT_PHASES_BACKBONE").as_deref() {
        Ok("conv4") => BackboneKind::Conv4,
        _ => BackboneKind::ResNet10,
    };
    let episodes: usize = std::env::var("FSCT_PHASES_EPISODES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6)
        .max(2);
    let dev = Device::Cpu;
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 0);
    let backbone = Backbone::new(&pb, kind, SIZE, kind == BackboneKind::Conv4)?;
    let model = FewShotModel::new(&pb, backbone, Method::FsctCosine, N_WAY, K_SHOT)?;
    let mut opt = ft_trainer::train::bench::f32_adamw(&store)?;
    let params: Vec<Var> = opt.params().to_vec();
    let n = N_WAY * (K_SHOT + N_QUERY);
    let episode = Episode {
        images: Tensor::randn(0f32, 1., (n, 3, SIZE, SIZE), &dev)?,
        n_way: N_WAY,
        k_shot: K_SHOT,
        n_query: N_QUERY,
    };
    let ck = Checkpointer::with_strategy(Strategy::None);
    let queries = (N_WAY * N_QUERY) as f64;
    let (mut forward, mut backward) = (0.0, 0.0);
    for i in 0..episodes {
        ck.begin_forward();
        let t0 = Instant::now();
        let (loss, _) = model.summed_loss(&episode, true, &ck)?;
        let loss = (loss / queries)?;
        let f = t0.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_millis(200));
        let t1 = Instant::now();
        let grads = ck.gradients(&loss, &params)?;
        drop(loss);
        let b = t1.elapsed().as_secs_f64();
        opt.step(grads, 1e-3)?;
        std::thread::sleep(Duration::from_millis(400));
        if i > 0 {
            forward += f;
            backward += b;
        }
        println!("{kind:?} episode {i}: forward {f:.3} s, backward {b:.3} s");
    }
    let rest = (episodes - 1) as f64;
    println!(
        "{kind:?}, after the first: forward {:.3} s, backward {:.3} s (means)",
        forward / rest,
        backward / rest
    );
    Ok(())
}
