//! sdxl-ft training on the bundled tiny pipeline, measured: the validation loss falls, every UNet
//! parameter gets a gradient, evaluation writes samples with the EMA swapped in and reports KID
//! and CMMD over a CLIP tower's features of samples from the demo's held-out captions, and memory
//! at the end of the MMD and at `eval/after` does not grow from one evaluation to the next (seed
//! 003). Alone in its test binary so the allocator's counts are this run's only.

mod common;

use common::{args, tensors, tiny_clip, tmp};
use ft_trainer::train;
use sdxl_ft::run::setup;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

#[test]
fn training_lowers_loss_writes_samples_and_evaluation_does_not_grow_memory() -> anyhow::Result<()> {
    let out = tmp("train");
    let clip = tiny_clip(&out.join("clip"))?.display().to_string();
    let a = args(
        &out,
        &[
            "--max-steps",
            "40",
            "--eval-every",
            "20",
            "--ema",
            "--ema-decay",
            "0.9",
            "--random-flip",
            "--caption-dropout",
            "0.1",
            "--snr-gamma",
            "5",
            "--vae-tile",
            "4",
            "--vae-decode-chunk",
            "2",
            "--eval-mmd-samples",
            "5",
            "--eval-clip-model",
            &clip,
        ],
    )?;
    let mut s = setup(&a)?;
    assert!(s.task.cache.built);
    // The demo's held-out images, not the training ones, are the real set.
    let mmd = s
        .task
        .mmd
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("no MMD"))?;
    assert_eq!((mmd.n, mmd.features()), (5, "clip"));
    assert!(mmd.cache.manifest.entries[0].file.contains("held-out"));
    let before = s.task.validation_loss()?;

    // Every UNet parameter gets a nonzero gradient from the task's loss.
    let params = s.optimizer.params().to_vec();
    let batch: Vec<usize> = (0..4).collect();
    let ctx = train::StepCtx {
        step: 0,
        micro: 0,
        dropout_seed: 7,
        first_sample: 0,
        checkpointer: &s.checkpointer,
    };
    let loss =
        train::Task::summed_loss(&mut s.task, &batch, &ctx).map_err(|e| anyhow::anyhow!("{e}"))?;
    let grads = s.checkpointer.gradients(&loss, &params)?;
    for (name, g) in s.optimizer.names().iter().zip(&grads) {
        let g = g
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("{name}: no gradient"))?;
        let n = g.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert!(n > 0.0, "{name}: zero gradient");
    }
    drop((loss, grads));

    let summary = s.train()?;
    let after = s.task.validation_loss()?;
    assert!(
        after < 0.7 * before,
        "validation loss {before:.4} -> {after:.4}"
    );
    for step in [20, 40] {
        let dir = out.join(format!("samples/step-{step}"));
        for f in ["sample-00.png", "sample-01.png", "grid.png"] {
            let img = image::open(dir.join(f))?;
            assert_eq!((img.width() % 32, img.height() % 32), (0, 0), "{f}");
        }
    }
    // Profile points of the two evaluations: the EMA swap happened, and the second evaluation
    // ends where the first did (nothing kept from one to the next).
    let live = |phase: &str| -> Vec<u64> {
        s.ledger
            .points()
            .iter()
            .filter(|p| p.phase == phase)
            .map(|p| p.live)
            .collect()
    };
    assert_eq!(live("eval/ema").len(), 2);
    let m = live("eval/mmd");
    assert_eq!(m.len(), 2);
    assert!(
        m[1] <= m[0] + 64 * 1024,
        "the MMD ended at {} bytes, then at {}",
        m[0],
        m[1]
    );
    for name in ["kid_clip", "cmmd_clip"] {
        let v = summary
            .last_eval
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .ok_or_else(|| anyhow::anyhow!("no {name} in {:?}", summary.last_eval))?;
        assert!(v.is_finite(), "{name} = {v}");
    }
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    assert_eq!(metrics.matches("\"eval_kid_clip\"").count(), 2, "{metrics}");
    let (b, e) = (live("eval/before"), live("eval/after"));
    assert_eq!(e.len(), 2);
    assert!(
        e[1] <= e[0] + 64 * 1024,
        "eval/after grew from {} to {}",
        e[0],
        e[1]
    );
    assert!(
        e[1] <= b[1] + 64 * 1024,
        "evaluation kept {} bytes",
        e[1] - b[1]
    );
    assert!(s.ledger.leak_suspects(3, 256 * 1024).is_empty());

    // diffusers layout, EMA beside it, different from the trained weights.
    let dir = summary.final_dir.clone().unwrap_or_default();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("unet/config.json"))?)?;
    assert_eq!(cfg["_class_name"], "UNet2DConditionModel");
    let unet = tensors(&dir.join("unet/diffusion_pytorch_model.safetensors"))?;
    let ema = tensors(&dir.join("unet_ema/diffusion_pytorch_model.safetensors"))?;
    assert_eq!(unet.len(), s.optimizer.names().len());
    assert_eq!(
        unet.iter().map(|t| &t.0).collect::<Vec<_>>(),
        ema.iter().map(|t| &t.0).collect::<Vec<_>>()
    );
    assert!(unet.iter().zip(&ema).any(|(a, b)| a.1 != b.1));
    std::fs::remove_dir_all(&out)?;
    Ok(())
}
