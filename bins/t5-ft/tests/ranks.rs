//! Data-parallel t5-ft under `mpirun` (#20): N ranks of `--accum A` train the weights one
//! process of `--accum N x A` trains on the same micro-batches (the same losses, the weights
//! within f32 rounding), through a short last step where a rank has no micro-batch, with
//! dropout drawn per micro-batch of the whole step; a resumed run continues the same curve; ranks
//! that disagree stop every rank with one error; the fused backward over ranks trains what one
//! process's fused backward trains; rank 0's plan is within 10% of its measured peak.
//! (Failures on one rank: `ranks_faults.rs`.) Needs the `mpi` feature and `mpirun` (skipped,
//! saying so, without one, unless FT_REQUIRE_MPI=1).
#![cfg(feature = "mpi")]

mod common;
#[path = "common/ranks.rs"]
mod ranks_common;

use std::path::Path;

use anyhow::Result;
use ft_params::weights::SafetensorsFiles;
use ranks_common::*;

#[test]
fn ranks_train_what_one_process_trains_on_the_combined_batch() -> Result<()> {
    let dir = common::tmp("ranks-equal");
    let (model, data) = model_and_data(&dir)?;
    let (m, d) = (model.display().to_string(), data.display().to_string());
    let args =
        |accum: &'static str| [&three_steps(&m, &d, accum)[..], &["--eval-file", &d]].concat();
    // 2 ranks x 2 micro-batches against 4 in one process: step 2 is the epoch's last micro-batch
    // alone, rank 1 has none. 3 ranks x 1 against 3. Then the same under ZeRO-1 and ZeRO-2
    // (each rank updating its share of the parameters; under ZeRO-2 each micro-batch's
    // gradients reduced to their owners, the rank without a micro-batch answering). Then with
    // the model in checkpoint segments (`blocks`), whose gradients the ranks sum segment by
    // segment inside the backward, against the one process without segments.
    let mut one_process = std::collections::HashMap::new();
    for (np, per_rank, whole, zero, segments) in [
        (2, "2", "4", "0", "none"),
        (3, "1", "3", "0", "none"),
        (2, "2", "4", "1", "none"),
        (3, "1", "3", "2", "none"),
        (2, "2", "4", "2", "none"),
        (2, "2", "4", "0", "blocks"),
        (3, "1", "3", "1", "blocks"),
        (2, "2", "4", "2", "blocks"),
    ] {
        let one = dir.join(format!("one-{whole}"));
        if let std::collections::hash_map::Entry::Vacant(e) = one_process.entry(whole) {
            let Some(losses) = train(1, &one, &args(whole))? else {
                unreachable!("one process needs no mpirun")
            };
            e.insert(losses);
        }
        let expected = &one_process[whole];
        let many = dir.join(format!("ranks-{np}-zero-{zero}-{segments}"));
        let sharded = [
            &args(per_rank)[..],
            &["--zero", zero, "--checkpointing", segments],
        ]
        .concat();
        let Some(got) = train(np, &many, &sharded)? else {
            return Ok(());
        };
        assert_eq!(got.len(), 3);
        for (a, b) in got.iter().zip(expected) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "{np} ranks, ZeRO-{zero}, {segments}: {got:?} vs {expected:?}"
            );
        }
        // Summed in another order (MPI's reduce, under ZeRO-2 a micro-batch at a time), a
        // gradient near zero rounds differently, and AdamW's m / sqrt(v) makes that a few
        // 1e-6 of a weight after 3 steps of 1e-3 (seen: 1.4e-6).
        let (diff, name) = weights(&many.join("checkpoint-3"))?
            .max_difference(&weights(&one.join("checkpoint-3"))?, |_| true)?;
        assert!(
            diff <= 1e-5,
            "{np} ranks, ZeRO-{zero}, {segments}: `{name}` differs by {diff}"
        );
        // Rank 0 alone wrote the run's files.
        assert!(many.join("memory.svg").is_file() && many.join("memory.jsonl").is_file());
        if zero != "0" {
            // The checkpoint holds the whole optimizer state, gathered from the ranks.
            let state =
                |d: &Path| SafetensorsFiles::open(&[d.join("checkpoint-3/optimizer.safetensors")]);
            let (diff, name) = state(&many)?.max_difference(&state(&one)?, |_| true)?;
            assert!(
                diff <= 1e-5,
                "{np} ranks, ZeRO-{zero}: state `{name}` differs by {diff}"
            );
            // While rank 0 held its share of it (the ledger's exact bytes).
            let (mine, all) = (
                held(&many, "optimizer_state")?,
                held(&one, "optimizer_state")?,
            );
            assert!(
                mine as f64 <= all as f64 * (1.0 / np as f64 + 0.05),
                "{np} ranks, ZeRO-{zero}: rank 0 held {mine} bytes of optimizer state, one process {all}"
            );
        }
        if zero == "2" {
            // Each micro-batch's gradients reduced onto their owners: rank 0's accumulator
            // held the fp32 sums of its share only, never the model's.
            let (mine, all) = (
                held_most(&many, "gradients")?,
                held_most(&one, "gradients")?,
            );
            assert!(
                mine > 0 && mine as f64 <= all as f64 * (1.0 / np as f64 + 0.05),
                "{np} ranks, ZeRO-2: rank 0 held {mine} bytes of gradients, one process {all}"
            );
        }
    }
    // Rank 1 taking rank 0's micro-batches (or the same dropout masks) would show here: the
    // loss of 2 ranks of 1 micro-batch is not the loss of one process of 1.
    let single = dir.join("one-1");
    let Some(alone) = train(1, &single, &args("1"))? else {
        unreachable!()
    };
    let Some(two) = train(2, &dir.join("ranks-2b"), &args("1"))? else {
        return Ok(());
    };
    assert!((alone[0] - two[0]).abs() > 1e-4, "{alone:?} vs {two:?}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Ranks on GPUs sum their gradients there, over NCCL (the `nccl` feature): 2 ranks x 2
/// micro-batches on 2 GPUs train what one process of 4 trains on one GPU, with the gradients
/// all-reduced, reduced to their owners (ZeRO-2) and summed segment by segment (the fused
/// backward). f32 weights, so that only the order of the sums differs. Needs 2 GPUs: skipped,
/// saying so, on a machine with fewer.
#[cfg(feature = "nccl")]
#[test]
fn ranks_on_gpus_sum_over_nccl_what_one_gpu_trains() -> Result<()> {
    let gpus = ft_dist::cudarc::driver::CudaContext::device_count().unwrap_or(0);
    if gpus < 2 {
        eprintln!("skipped: 2 ranks on GPUs need 2 GPUs; this machine has {gpus}");
        return Ok(());
    }
    let dir = common::tmp("ranks-nccl");
    let (model, data) = model_and_data(&dir)?;
    let (m, d) = (model.display().to_string(), data.display().to_string());
    let gpu = ["--device", "cuda", "--precision", "f32"];
    let fused = ["--fused-backward", "--checkpointing", "blocks"];
    for (case, extra) in [&[][..], &["--zero", "2"], &fused].into_iter().enumerate() {
        let args = |accum| [&three_steps(&m, &d, accum)[..], &gpu, extra].concat();
        let one = dir.join(format!("one-{case}"));
        let Some(expected) = train(1, &one, &args("4"))? else {
            unreachable!("one process needs no mpirun")
        };
        let many = dir.join(format!("ranks-{case}"));
        let Some(got) = train(2, &many, &args("2"))? else {
            return Ok(());
        };
        assert_eq!(got.len(), 3);
        for (a, b) in got.iter().zip(&expected) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{extra:?}: {got:?} vs {expected:?}"
            );
        }
        let (diff, name) = weights(&many.join("checkpoint-3"))?
            .max_difference(&weights(&one.join("checkpoint-3"))?, |_| true)?;
        assert!(diff <= 1e-5, "{extra:?}: `{name}` differs by {diff}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The fused backward over ranks: each segment's gradients summed over the ranks as its
/// backward ends, then updated. 2 ranks x 2 micro-batches (the earlier one accumulated, the
/// epoch's short last step leaving rank 1 without one, so that it only answers the rounds) and
/// 3 ranks x 1 train what one process's fused backward trains on the combined batch, with
/// per-tensor clipping (a gradient clipped on one rank's share would differ) and bf16 weights
/// over fp32 masters; also under ZeRO-2 (2 ranks, the earlier micro-batch's gradients reduced
/// onto their owners, which add their sums as the last one's arrive) and ZeRO-1 (3 ranks):
/// each round's sums reach the owners, which update and then send the weights.
#[test]
fn the_fused_backward_over_ranks_trains_what_one_process_trains() -> Result<()> {
    let dir = common::tmp("ranks-fused");
    let (model, data) = model_and_data(&dir)?;
    let (m, d) = (model.display().to_string(), data.display().to_string());
    let args = |accum: &'static str, zero: &'static str| {
        let fused = [
            "--zero",
            zero,
            "--fused-backward",
            "--checkpointing",
            "blocks",
            "--max-grad-norm",
            "0.05",
            "--precision",
            "bf16",
        ];
        [&three_steps(&m, &d, accum)[..], &fused].concat()
    };
    for (np, per_rank, whole, zero) in [
        (2, "2", "4", "0"),
        (3, "1", "3", "0"),
        (2, "2", "4", "2"),
        (3, "1", "3", "1"),
    ] {
        let one = dir.join(format!("one-{whole}"));
        if !one.exists() {
            let Some(_) = train(1, &one, &args(whole, "0"))? else {
                unreachable!("one process needs no mpirun")
            };
        }
        let expected: Vec<f64> =
            ft_trainer::train::metrics::logged(&one.join("metrics.jsonl"), "loss")?
                .iter()
                .filter_map(|v| v.as_f64())
                .collect();
        let many = dir.join(format!("ranks-{np}-zero-{zero}"));
        let Some(got) = train(np, &many, &args(per_rank, zero))? else {
            return Ok(());
        };
        assert_eq!(got.len(), 3);
        for (a, b) in got.iter().zip(&expected) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{np} ranks, ZeRO-{zero}: {got:?} vs {expected:?}"
            );
        }
        let (diff, name) = weights(&many.join("checkpoint-3"))?
            .max_difference(&weights(&one.join("checkpoint-3"))?, |_| true)?;
        assert!(
            diff <= 1e-5,
            "{np} ranks, ZeRO-{zero}: `{name}` differs by {diff}"
        );
        let state =
            |d: &Path| SafetensorsFiles::open(&[d.join("checkpoint-3/optimizer.safetensors")]);
        let (diff, name) = state(&many)?.max_difference(&state(&one)?, |_| true)?;
        assert!(
            diff <= 1e-5,
            "{np} ranks, ZeRO-{zero}: state `{name}` differs by {diff}"
        );
        if zero != "0" {
            // The state was partitioned: rank 0 held its share, less than one process's.
            let (share, whole) = (
                held_most(&many, "optimizer_state")?,
                held_most(&one, "optimizer_state")?,
            );
            assert!(
                share > 0 && share < whole,
                "ZeRO-{zero}: rank 0's optimizer state {share} B, one process's {whole} B"
            );
        }
    }
    // Under ZeRO-2 the earlier micro-batch's gradients went to their owners: in f32 (where a
    // share of fp32 sums is not the size of a whole micro-batch's bf16 gradients) rank 0 held
    // about half the gradient bytes it holds without ZeRO.
    let mut held = Vec::new();
    for zero in ["0", "2"] {
        let f32_run: Vec<&str> = args("2", zero)
            .into_iter()
            .map(|a| if a == "bf16" { "f32" } else { a })
            .collect();
        let out = dir.join(format!("f32-zero-{zero}"));
        let Some(_) = train(2, &out, &f32_run)? else {
            return Ok(());
        };
        held.push(held_most(&out, "gradients")?);
    }
    assert!(
        held[1] > 0 && (held[1] as f64) < 0.6 * held[0] as f64,
        "fused, f32: rank 0 held {} bytes of gradients under ZeRO-2, {} without",
        held[1],
        held[0]
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn ranks_resume_the_same_curve() -> Result<()> {
    let dir = common::tmp("ranks-resume");
    let (model, data) = model_and_data(&dir)?;
    let (m, d) = (model.display().to_string(), data.display().to_string());
    let base = [&small_run(&m, &d)[..], &["--accum", "2"]].concat();
    let steps = |n: &'static str| [&base[..], &["--max-steps", n]].concat();
    let Some(whole) = train(2, &dir.join("whole"), &steps("4"))? else {
        return Ok(());
    };
    // The run stopped at step 2 (as a kill after its checkpoint would), then resumed.
    let first = dir.join("first");
    train(2, &first, &steps("2"))?;
    let ck = first.join("checkpoint-2").display().to_string();
    let mut resume = steps("4");
    resume.extend(["--resume", &ck]);
    let Some(rest) = train(2, &first, &resume)? else {
        return Ok(());
    };
    assert_eq!(
        rest, whole,
        "the resumed curve (with the first run's 2 steps)"
    );
    let (diff, name) = weights(&first.join("checkpoint-4"))?
        .max_difference(&weights(&dir.join("whole/checkpoint-4"))?, |_| true)?;
    assert_eq!(diff, 0.0, "`{name}`");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Rank 0's plan of its own peak (what `--plan --plan-ranks N` prints: its share of the
/// state under ZeRO, the sums in flight) is within 10% of the peak its ledger measured (the
/// exact heap of the training phases, the counting allocator's), as `--fit` needs: 2 ranks x 2
/// micro-batches under ZeRO 0 and 2, plain and in segments summed inside the backward, and
/// with the fused backward's rounds; 2 ranks x 1 under ZeRO-2 (no accumulator: the sums arrive
/// after backward); 3 ranks under ZeRO-1. The run writes both to its
/// metrics.jsonl (`predicted_peak_bytes`, `peak_bytes`) every step.
#[test]
fn a_ranks_plan_is_near_its_measured_peak() -> Result<()> {
    let dir = common::tmp("ranks-plan");
    let (model, data) = model_and_data(&dir)?;
    let (m, d) = (model.display().to_string(), data.display().to_string());
    let mut table = String::from(
        "| ranks | --zero | --checkpointing | fused | --accum | plan | run | plan / run |\n",
    );
    let mut bad = Vec::new();
    for (np, zero, ck, fused, accum) in [
        (2, "0", "none", false, "2"),
        (2, "2", "none", false, "2"),
        // One micro-batch a step: ZeRO-2's sums arrive after backward, with no accumulator.
        (2, "2", "none", false, "1"),
        (2, "0", "blocks", false, "2"),
        (2, "2", "blocks", true, "2"),
        (2, "0", "full", true, "2"),
        (3, "1", "blocks", false, "2"),
    ] {
        let out = dir.join(format!("run-{np}-{zero}-{ck}-{fused}-{accum}"));
        let mut args = [
            &three_steps(&m, &d, accum)[..],
            &["--zero", zero, "--checkpointing", ck],
        ]
        .concat();
        if fused {
            args.push("--fused-backward");
        }
        if train(np, &out, &args)?.is_none() {
            return Ok(());
        }
        let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
        let last = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .rfind(|r| r["step"] == 3 && r.get("loss").is_some())
            .ok_or_else(|| anyhow::anyhow!("no step 3 in {}", out.display()))?;
        let (Some(plan), Some(run)) = (
            last["predicted_peak_bytes"].as_u64(),
            last["peak_bytes"].as_u64(),
        ) else {
            anyhow::bail!("no predicted or measured peak in {last}");
        };
        let ratio = plan as f64 / run as f64;
        table += &format!(
            "| {np} | {zero} | {ck} | {fused} | {accum} | {plan} | {run} | {ratio:.3} |\n"
        );
        if (ratio - 1.0).abs() > 0.10 {
            bad.push(format!(
                "{np} ranks, ZeRO-{zero}, {ck}, fused {fused}, accum {accum}: {ratio:.3}"
            ));
        }
    }
    eprintln!("{table}");
    assert!(
        bad.is_empty(),
        "plan / run off by more than 10%: {bad:?}\n{table}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A ZeRO checkpoint holds the whole state (gathered to rank 0): 2 ranks under ZeRO-2 with
/// bf16 weights (their fp32 masters partitioned too) and 8-bit moments stop at step 2 and one
/// process resumes the curve one process trains; one process's checkpoint resumes as 2 ranks
/// under ZeRO-1 (each rank restoring its share).
#[test]
fn zero_checkpoints_resume_at_another_number_of_ranks() -> Result<()> {
    let dir = common::tmp("ranks-zero-resume");
    let (model, data) = model_and_data(&dir)?;
    let (m, d) = (model.display().to_string(), data.display().to_string());
    let base = [
        &small_run(&m, &d)[..],
        &["--optim", "adamw8bit", "--precision", "bf16", "--max-steps"],
    ]
    .concat();
    let run = |np: usize, out: &str, steps: &str, extra: &[&str]| {
        let args = [&base[..], &[steps], extra].concat();
        train(np, &dir.join(out), &args)
    };
    let Some(whole) = run(1, "whole", "4", &["--accum", "4"])? else {
        unreachable!("one process needs no mpirun")
    };
    let Some(_) = run(2, "zero2", "2", &["--accum", "2", "--zero", "2"])? else {
        return Ok(());
    };
    // Rank 0 kept the fp32 masters of its share of the parameters only.
    let zero2 = dir.join("zero2");
    let (mine, all) = (
        held(&zero2, "master_weights")?,
        held(&dir.join("whole"), "master_weights")?,
    );
    assert!(
        mine > 0 && mine as f64 <= all as f64 * 0.55,
        "rank 0 held {mine} bytes of masters, one process {all}"
    );
    let ck = |out: &str| dir.join(out).join("checkpoint-2").display().to_string();
    let Some(one) = run(1, "zero2", "4", &["--accum", "4", "--resume", &ck("zero2")])? else {
        unreachable!()
    };
    let (diff, name) = weights(&dir.join("zero2/checkpoint-4"))?
        .max_difference(&weights(&dir.join("whole/checkpoint-4"))?, |_| true)?;
    assert!(diff <= 1e-5, "`{name}` differs by {diff}");
    // Resumed in its own folder: the curve from step 2 on.
    let from_whole = ["--accum", "2", "--zero", "1", "--resume", &ck("whole")];
    let Some(two) = run(2, "whole-then-2", "4", &from_whole)? else {
        return Ok(());
    };
    for (what, got, want) in [
        ("2 ranks, then one process", &one[..], &whole[..]),
        ("one process, then 2 ranks", &two[..], &whole[2..]),
    ] {
        assert_eq!(got.len(), want.len(), "{what}");
        for (a, b) in got.iter().zip(want) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{what}: {got:?} vs {want:?}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn ranks_that_disagree_stop_together() -> Result<()> {
    let dir = common::tmp("ranks-refused");
    let out = dir.display().to_string();
    let Some(mut cmd) = ft_dist::mpirun(1)? else {
        eprintln!("skipped: no mpirun on PATH");
        return Ok(());
    };
    // Two ranks started with different learning rates (mpirun's `:` starts each its own way).
    let common = [
        "--demo",
        "--max-steps",
        "2",
        "--quiet",
        "--output-dir",
        &out,
    ];
    let r = cmd
        .arg(BIN)
        .args(common)
        .args(["--lr", "1e-4", ":", "-np", "1", BIN])
        .args(common)
        .args(["--lr", "2e-4"])
        .output()?;
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success(), "{err}");
    assert!(
        err.contains("the ranks disagree on the configuration") && err.contains("rank 1 differs"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
