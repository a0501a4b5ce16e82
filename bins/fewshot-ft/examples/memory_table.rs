//! `cargo run -p fewshot-ft --example memory_table`: measured peak memory of one training step
//! (forward, backward, accumulation, AdamW) for Conv4 and ResNet18 FSCT_cosine, 5-way 1-shot, at
//! several n_query / accumulation settings with the same number of queries per update: the
//! measured replacement for the seed's "recommended settings by GPU memory" guess.
//!
//! Peaks are exact heap bytes above the post-warm-up level (counting allocator, f32, CPU). On a
//! GPU the activation part is the same tensors; the CUDA figures come with the GPU work.

use std::time::Instant;

use candle_core::{DType, Device, Var};
use fewshot_ft::data::{sample_episode, EpisodeShape, ImageConfig, Splits};
use ft_models::fewshot::{Backbone, BackboneKind, FewShotModel, Method};
use ft_params::bytes::format_bytes;
use ft_params::checkpoint::Checkpointer;
use ft_params::{ParamBuilder, ParamStore};
use ft_trainer::update::{GradAccumulator, LossNorm};

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

fn measure(
    kind: BackboneKind,
    size: usize,
    n_query: usize,
    accum: usize,
) -> anyhow::Result<(u64, u64, f64)> {
    let dev = Device::Cpu;
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 0);
    let shape = EpisodeShape {
        n_way: 5,
        k_shot: 1,
        n_query,
    };
    let model = FewShotModel::new(
        &pb,
        Backbone::new(&pb, kind, size, true)?,
        Method::FsctCosine,
        5,
        1,
    )?;
    let mut opt = ft_trainer::train::bench::f32_adamw(&store)?;
    let params: Vec<Var> = opt.params().to_vec();
    let splits = Splits::synthetic(20, n_query + 1, 0);
    let img = ImageConfig {
        size,
        augment: false,
    };
    let ck = Checkpointer::new(false);
    let mut step = |seed: u64| -> anyhow::Result<()> {
        let eps: Vec<_> = (0..accum)
            .map(|i| sample_episode(&splits.train, shape, seed, i as u64, img, &dev))
            .collect::<Result<_, _>>()?;
        let norm = LossNorm::samples(&vec![5 * n_query; accum]);
        let mut acc = GradAccumulator::new();
        for e in &eps {
            let (l, _) = model.summed_loss(e, true, &ck)?;
            acc.add(ck.gradients(&norm.scale(&l)?, &params)?)?;
        }
        opt.step(acc.take(), 1e-3)?;
        Ok(())
    };
    step(1)?;
    let base = ft_trainer::ledger::alloc::reset_peak() as u64;
    let t0 = Instant::now();
    step(2)?;
    let secs = t0.elapsed().as_secs_f64();
    let peak = ft_trainer::ledger::alloc::peak_bytes() as u64 - base;
    Ok((peak, store.count(true).1, secs))
}

fn main() -> anyhow::Result<()> {
    println!(
        "FSCT_cosine 5-way 1-shot, one optimizer step, f32, CPU ({} threads)\n",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    println!("| backbone | image | n_query | accumulation | queries per update | peak above weights+state | parameters | step time |");
    println!("|---|---|---|---|---|---|---|---|");
    let runs: &[(BackboneKind, &str, usize, usize, usize)] = &[
        (BackboneKind::Conv4, "Conv4", 84, 16, 1),
        (BackboneKind::Conv4, "Conv4", 84, 8, 2),
        (BackboneKind::Conv4, "Conv4", 84, 4, 4),
        (BackboneKind::ResNet18, "ResNet18", 112, 16, 1),
        (BackboneKind::ResNet18, "ResNet18", 112, 8, 2),
        (BackboneKind::ResNet18, "ResNet18", 112, 4, 4),
    ];
    for &(kind, name, size, nq, acc) in runs {
        let (peak, pbytes, secs) = measure(kind, size, nq, acc)?;
        println!(
            "| {name} | {size} px | {nq} | {acc} | {} | {} | {} | {secs:.2} s |",
            5 * nq * acc,
            format_bytes(peak as i64),
            format_bytes(pbytes as i64)
        );
    }
    Ok(())
}
