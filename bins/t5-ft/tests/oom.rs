//! Out of memory in a step (on the CPU: the `--fit` budget passed, as the counting allocator
//! measures it): the loop drops the step, splits each micro-batch in two over the same samples,
//! runs the step again and goes on, with the update the whole step would have made; a step
//! that cannot fit even at one sample a part stops with one clear error and the memory table.
//!
//! The model has dropout: the masks of a split micro-batch must be the whole's.
//! One test in this binary: the counting allocator counts every thread.

mod common;

use std::path::Path;

use common::{long_examples, tmp};
use ft_trainer::train;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

/// The demo's model with dropout 0.1 (the demo's own has none) and its data in `dir`.
fn model_with_dropout(dir: &Path) -> anyhow::Result<()> {
    t5_ft::demo::write(dir, 16, 8, 0)?;
    let path = dir.join("model/config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    cfg["dropout_rate"] = 0.1.into();
    std::fs::write(&path, cfg.to_string())?;
    Ok(())
}

/// That model on examples at the maximum lengths (activations dominate), batch 8 a step,
/// 2 steps (`extra` flags and values replace or add to these), plain SGD (the update is the
/// gradient scaled, so weights compare as gradients).
fn session(
    out: &Path,
    data: &Path,
    long: &Path,
    extra: &[&str],
) -> anyhow::Result<train::Session<t5_ft::task::T5Task>> {
    let long = long.display().to_string();
    let model = data.join("model").display().to_string();
    let eval = data.join("eval.jsonl").display().to_string();
    let out = out.display().to_string();
    let mut args = vec![
        "t5-ft",
        "--model",
        &model,
        "--from-scratch",
        "--eval-file",
        &eval,
        "--train-file",
        &long,
        "--batch-size",
        "8",
        "--accum",
        "1",
        "--max-steps",
        "2",
        "--optim",
        "sgd",
        "--lr",
        "0.5",
        "--weight-decay",
        "0",
        "--warmup-steps",
        "0",
        "--max-grad-norm",
        "0",
        "--quiet",
        "--output-dir",
        &out,
    ];
    // Each (flag, value) of `extra` replaces the flag's value above, or is added.
    for pair in extra.chunks(2) {
        match args.iter().position(|a| *a == pair[0]) {
            Some(i) => args[i + 1] = pair[1],
            None => args.extend_from_slice(pair),
        }
    }
    let args: t5_ft::cli::Args = train::parse_args_from(args)?;
    t5_ft::run::setup(&args)
}

fn weights(s: &train::Session<t5_ft::task::T5Task>) -> anyhow::Result<Vec<f32>> {
    let mut all = Vec::new();
    for p in s.optimizer.params() {
        all.extend(p.as_tensor().flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(all)
}

fn metrics(out: &Path) -> anyhow::Result<Vec<serde_json::Value>> {
    std::fs::read_to_string(out.join("metrics.jsonl"))?
        .lines()
        .map(|l| Ok(serde_json::from_str(l)?))
        .collect()
}

#[test]
fn out_of_memory_splits_the_micro_batch_and_keeps_the_update() -> anyhow::Result<()> {
    let out = tmp("oom");
    let data = out.join("data");
    let long = long_examples(&data)?;
    model_with_dropout(&data)?;

    // Whole micro-batches, no budget: the reference, and its training peak as the plan counts.
    let mut whole = session(&out.join("whole"), &data, &long, &[])?;
    let summary = whole.train()?;
    let ledger = &whole.ledger;
    let (_, max_planned) = ledger
        .peak_against_plan()
        .ok_or_else(|| anyhow::anyhow!("the CPU is not measured"))?;
    let peak_of = |phases: &[&str]| {
        ledger
            .points()
            .iter()
            .filter(|p| phases.contains(&p.phase.as_str()))
            .map(|p| p.peak)
            .max()
            .unwrap_or(0)
    };
    // The plan's peak is the training phases' (not the evaluation's): what it subtracts.
    let offset = peak_of(&["forward", "backward", "step"]) - max_planned;
    let train_peak = peak_of(&["forward", "backward"]) - offset;
    let reference = weights(&whole)?;
    drop(whole);

    // A budget 20% under that peak: the first step passes it, is split in two and run again;
    // the second starts split.
    let budget = train_peak * 8 / 10;
    let mut split = session(&out.join("split"), &data, &long, &[])?;
    split.loop_config.budget = Some(budget);
    let retried = split.train()?;
    let lines = metrics(&out.join("split"))?;
    let events: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["event"] == "out_of_memory")
        .collect();
    assert_eq!(events.len(), 1, "{lines:?}");
    assert_eq!(events[0]["micro_batches_before"], 1);
    assert_eq!(events[0]["micro_batches_after"], 2);
    let steps: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 2);
    assert!(steps.iter().all(|l| l["micro_batches"] == 2), "{lines:?}");
    // Every step after the split stayed within the budget.
    for p in split
        .ledger
        .points()
        .iter()
        .skip_while(|p| p.phase != "step")
    {
        if p.phase == "forward" || p.phase == "backward" {
            assert!(
                p.peak - offset <= budget,
                "{} peaked at {} over {budget}",
                p.phase,
                p.peak - offset
            );
        }
    }
    // The same losses and the same update, within f32 rounding (the halves sum their losses
    // and gradients in another order; dropout draws the same masks).
    for (a, b) in summary.losses.iter().zip(&retried.losses) {
        assert!((a - b).abs() < 1e-5 * a.abs().max(1.0), "loss {a} vs {b}");
    }
    // The run drew its timeline with the budget it kept.
    let picture = std::fs::read_to_string(out.join("split/memory.svg"))?;
    assert!(picture.contains("--fit budget"), "{picture}");
    let after = weights(&split)?;
    let worst = reference
        .iter()
        .zip(&after)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-5, "weights differ by up to {worst}");
    drop(split);

    // Resumed from the split run's checkpoint under the same budget, a step more: the split
    // is saved with the checkpoint, so the step starts split and runs out of memory no more.
    let saved = out.join("split/checkpoint-2").display().to_string();
    let mut resumed = session(
        &out.join("resumed"),
        &data,
        &long,
        &["--resume", &saved, "--max-steps", "3"],
    )?;
    resumed.loop_config.budget = Some(budget);
    resumed.train()?;
    let lines = metrics(&out.join("resumed"))?;
    assert!(
        lines.iter().all(|l| l["event"] != "out_of_memory"),
        "{lines:?}"
    );
    assert!(
        lines.iter().any(|l| l["event"] == "resumed_split"),
        "{lines:?}"
    );
    let steps: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 1, "{lines:?}");
    assert_eq!(steps[0]["micro_batches"], 2, "{lines:?}");
    drop(resumed);
    // With another micro-batch size the split does not apply: the step starts whole.
    let mut other = session(
        &out.join("other"),
        &data,
        &long,
        &["--resume", &saved, "--max-steps", "3", "--batch-size", "4"],
    )?;
    other.train()?;
    let lines = metrics(&out.join("other"))?;
    let steps: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(steps[0]["micro_batches"], 1, "{lines:?}");

    // A budget no part fits: split down to one sample a part, then one clear error with the
    // memory table of the moment; nothing saved.
    let mut tiny = session(&out.join("tiny"), &data, &long, &[])?;
    tiny.loop_config.budget = Some(1 << 10);
    let err = match tiny.train() {
        Ok(_) => anyhow::bail!("a 1 KiB budget trained"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("over the --fit budget"), "{err}");
    assert!(err.contains("smallest size they split to"), "{err}");
    assert!(err.contains("memory by component"), "{err}");
    let retries = metrics(&out.join("tiny"))?
        .iter()
        .filter(|l| l["event"] == "out_of_memory")
        .count();
    assert_eq!(retries, 3, "8 -> 4 -> 2 -> 1 samples a part");
    assert!(!out.join("tiny/checkpoint-1").exists());
    // A failed run draws its picture too, its peak marked in the phase that passed the budget.
    let picture = std::fs::read_to_string(out.join("tiny/memory.svg"))?;
    assert!(
        picture.contains(" in forward<") || picture.contains(" in backward<"),
        "{picture}"
    );
    std::fs::remove_dir_all(&out)?;
    Ok(())
}
