//! Data-parallel t5-ft under `mpirun` (#20) when one rank fails (`FT_FAULT`, made on purpose
//! where no input can make one rank alone fail): a rank failing inside the fused backward ends
//! the run and spares the last checkpoint; a NaN gradient on one rank is skipped by its owner
//! alone under ZeRO-2; one rank passing its `--fit` budget, or running out of memory between
//! two segments' sums, splits every rank's micro-batches. Needs the `mpi` feature and `mpirun`
//! (skipped, saying so, without one, unless FT_REQUIRE_MPI=1).
#![cfg(feature = "mpi")]

mod common;
#[path = "common/ranks.rs"]
mod ranks_common;

use std::path::Path;

use anyhow::{ensure, Result};
use ft_params::weights::SafetensorsFiles;
use ranks_common::*;

/// A rank that fails inside the fused backward across ranks (`FT_FAULT`: rank 1, in step 3's
/// first round, while rank 0 waits in the same collective) ends both ranks promptly with its
/// error, and the checkpoint of step 2 is whole: resumed from it, 2 ranks train the curve and
/// the weights of a run that did not fail.
#[test]
fn a_rank_failing_in_the_fused_backward_ends_the_run_and_spares_the_checkpoint() -> Result<()> {
    let dir = common::tmp("ranks-fused-fault");
    let (model, data) = model_and_data(&dir)?;
    let (m, d) = (model.display().to_string(), data.display().to_string());
    let fused = ["--fused-backward", "--checkpointing", "blocks"];
    let base = [&small_run(&m, &d)[..], &fused].concat();
    let steps = |n: &'static str| [&base[..], &["--max-steps", n]].concat();
    let Some(whole) = train(2, &dir.join("whole"), &steps("4"))? else {
        return Ok(());
    };
    let failed = dir.join("failed");
    let started = std::time::Instant::now();
    let Some(r) = with_fault(&steps("4"), &failed, "fused-round:1:3")? else {
        return Ok(());
    };
    let took = started.elapsed().as_secs_f64();
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success(), "{err}");
    assert!(
        err.contains("Error (rank 1 of 2)")
            && err.contains("made on purpose at fused-round, rank 1, step 3")
            && err.contains("in the fused backward"),
        "{err}"
    );
    // The whole 4-step run takes seconds: a rank left waiting would hold it to the limit.
    assert!(took < 120.0, "ended after {took:.0} s: a rank hung? {err}");
    assert!(failed.join("checkpoint-2").exists() && !failed.join("checkpoint-4").exists());
    let ck = failed.join("checkpoint-2").display().to_string();
    let resume = [&steps("4")[..], &["--resume", &ck]].concat();
    let Some(rest) = train(2, &failed, &resume)? else {
        return Ok(());
    };
    assert_eq!(
        rest, whole,
        "the resumed curve (with the failed run's 2 steps)"
    );
    let (diff, name) = weights(&failed.join("checkpoint-4"))?
        .max_difference(&weights(&dir.join("whole/checkpoint-4"))?, |_| true)?;
    assert_eq!(diff, 0.0, "`{name}`");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A gradient that turns NaN on one rank (`FT_FAULT=nan-gradient:0:2`: the first tensor rank
/// 0 offers in step 2's rounds, a step in which rank 1 has no micro-batch) skips that tensor's update and no other, under the fused
/// backward with per-tensor clipping: under ZeRO-2 its owner alone skips it, sends the others
/// the weight unchanged and counts the step as one process would, so the run equals the one in
/// which every rank skips it (no ZeRO): the same losses, weights and optimizer state (its step
/// count too), and step 2 alone reports the non-finite gradient on both.
#[test]
fn a_non_finite_gradient_on_one_rank_skips_one_tensor_under_fused_zero() -> Result<()> {
    let dir = common::tmp("ranks-fused-nan");
    let (model, data) = model_and_data(&dir)?;
    let (m, d) = (model.display().to_string(), data.display().to_string());
    let fused = ["--fused-backward", "--checkpointing", "blocks"];
    let clip = ["--max-grad-norm", "0.05"];
    let mut runs = Vec::new();
    for zero in ["0", "2"] {
        let args = [
            &three_steps(&m, &d, "2")[..],
            &fused,
            &clip,
            &["--zero", zero],
        ]
        .concat();
        let out = dir.join(format!("zero-{zero}"));
        let Some(r) = with_fault(&args, &out, "nan-gradient:0:2")? else {
            return Ok(());
        };
        assert!(
            r.status.success(),
            "ZeRO-{zero}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        let (_, _, steps) = metrics(&out)?;
        let flags: Vec<_> = steps.iter().map(|l| l["non_finite"].clone()).collect();
        assert_eq!(flags, [false, true, false], "ZeRO-{zero}: {steps:?}");
        runs.push(out);
    }
    let losses = |out: &Path| -> Result<Vec<f64>> {
        Ok(metrics(out)?
            .2
            .iter()
            .filter_map(|l| l["loss"].as_f64())
            .collect())
    };
    let (a, b) = (losses(&runs[0])?, losses(&runs[1])?);
    assert!(
        a.iter()
            .zip(&b)
            .all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs()),
        "{a:?} vs {b:?}"
    );
    let (diff, name) = weights(&runs[1].join("checkpoint-3"))?
        .max_difference(&weights(&runs[0].join("checkpoint-3"))?, |_| true)?;
    assert!(diff <= 1e-5, "`{name}` differs by {diff}");
    let state = |d: &Path| SafetensorsFiles::open(&[d.join("checkpoint-3/optimizer.safetensors")]);
    let (diff, name) = state(&runs[1])?.max_difference(&state(&runs[0])?, |_| true)?;
    assert!(diff <= 1e-5, "state `{name}` differs by {diff}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Under `--fit` with the fused backward, one rank's phase passing the budget splits every
/// rank alike (`FT_FAULT` makes it pass): in forward the ranks agree before any update and run
/// the step again split; in the fused backward the update stands and every rank splits the
/// steps after it (without that agreement only the rank that passed would: the second case
/// fails). A rank with nothing to split that step splits alike. Rank 0 logs the split and runs
/// its micro-batches split from then on, and the losses are those of a run that never split
/// (f32 rounding).
#[test]
fn a_rank_over_its_fit_budget_splits_every_rank() -> Result<()> {
    let dir = common::tmp("ranks-fit-split");
    let (model, data) = model_and_data(&dir)?;
    let (m, d) = (model.display().to_string(), data.display().to_string());
    let fit = [
        "--fused-backward",
        "--checkpointing",
        "blocks",
        "--fit",
        "2GiB",
        "--max-steps",
        "4",
    ];
    let args = [&from_scratch(&m, &d)[..], &fit].concat();
    let Some(plain) = train(2, &dir.join("plain"), &args)? else {
        return Ok(());
    };
    // (point, rank, step, the first step that runs split): the last row passes the budget on
    // rank 0 in step 3, where rank 1 has no micro-batch (10 examples, 2 a micro-batch, 2 ranks):
    // rank 1 splits alike instead of failing for want of anything to split.
    for (point, rank, at, first_split) in [
        ("fit-budget-forward", 1, 2, 2),
        ("fit-budget-backward", 1, 2, 3),
        ("fit-budget-forward", 0, 3, 3),
    ] {
        let out = dir.join(format!("{point}-{rank}-{at}"));
        let Some(r) = with_fault(&args, &out, &format!("{point}:{rank}:{at}"))? else {
            return Ok(());
        };
        ensure!(
            r.status.success(),
            "{point}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        let (lines, events, steps) = metrics(&out)?;
        assert_eq!(events.len(), 1, "{point}: {lines:?}");
        assert_eq!(events[0]["step"], at, "{point}: {lines:?}");
        assert_eq!(steps.len(), 4, "{point}: {lines:?}");
        for (k, s) in steps.iter().enumerate() {
            let split = if k + 1 >= first_split { 2 } else { 1 };
            assert_eq!(
                s["micro_batches"],
                split,
                "{point}, step {}: {lines:?}",
                k + 1
            );
            let (a, b) = (s["loss"].as_f64().unwrap_or(f64::NAN), plain[k]);
            assert!((a - b).abs() <= 1e-5 * b.abs(), "{point}: loss {a} vs {b}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A rank running out of memory inside a backward whose segments' gradients the ranks sum as
/// they end (`FT_FAULT`'s `reduce-round`: rank 1, between two segments' rounds of step 3)
/// tells the others in the next round; every rank stops its backward, drops the step's sums
/// and runs the step again split, and the curve is the one of a run that never failed (f32
/// rounding): without ZeRO (the step's last micro-batch summed in the backward) and under
/// ZeRO-2 (each micro-batch's). The fault fires only between segments' rounds: a backward
/// that summed the gradients after it ended would leave no event, and fail here.
#[test]
fn a_rank_out_of_memory_between_segment_sums_splits_every_rank() -> Result<()> {
    let dir = common::tmp("ranks-reduce-oom");
    let (model, data) = model_and_data(&dir)?;
    let (m, d) = (model.display().to_string(), data.display().to_string());
    for zero in ["0", "2"] {
        let args = [
            &from_scratch(&m, &d)[..],
            &[
                "--checkpointing",
                "blocks",
                "--accum",
                "2",
                "--max-steps",
                "4",
            ],
            &["--zero", zero],
        ]
        .concat();
        let Some(plain) = train(2, &dir.join(format!("plain-{zero}")), &args)? else {
            return Ok(());
        };
        let out = dir.join(format!("failed-{zero}"));
        let Some(r) = with_fault(&args, &out, "reduce-round:1:3")? else {
            return Ok(());
        };
        ensure!(
            r.status.success(),
            "ZeRO-{zero}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        let (lines, events, steps) = metrics(&out)?;
        assert_eq!(events.len(), 1, "ZeRO-{zero}: {lines:?}");
        assert_eq!(events[0]["step"], 3, "ZeRO-{zero}: {lines:?}");
        // Rank 0's micro-batches (5 an epoch, 4 a step over the ranks: step 2 is the epoch's
        // last alone, where rank 1 has none), in two parts each from step 3 on.
        let parts = [2, 1, 4, 2];
        assert_eq!(steps.len(), parts.len(), "ZeRO-{zero}: {lines:?}");
        for ((k, s), parts) in steps.iter().enumerate().zip(parts) {
            assert_eq!(s["micro_batches"], parts, "ZeRO-{zero}, step {}", k + 1);
            let (a, b) = (s["loss"].as_f64().unwrap_or(f64::NAN), plain[k]);
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "ZeRO-{zero}: loss {a} vs {b}"
            );
        }
        let (diff, name) = weights(&out.join("checkpoint-4"))?.max_difference(
            &weights(&dir.join(format!("plain-{zero}/checkpoint-4")))?,
            |_| true,
        )?;
        assert!(diff <= 1e-5, "ZeRO-{zero}: `{name}` differs by {diff}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
