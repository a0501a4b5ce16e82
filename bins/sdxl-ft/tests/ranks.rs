//! Data-parallel sdxl-ft under `mpirun` (#20): 2 ranks of `--accum 1` and 3 of `--accum 1`
//! train the UNet (and its EMA) that one process of `--accum 2` and `--accum 3` trains on the same
//! images, noise, timesteps, flips and caption dropout (drawn per micro-batch of the whole step),
//! within f32 rounding, also under ZeRO-2 and with the fused backward; each rank keeps its
//! share of the EMA, and rank 0 evaluates with the whole and saves it; 2 ranks resume one
//! process's checkpoint. Needs the `mpi` feature and `mpirun` (skipped, saying so, without one,
//! unless FT_REQUIRE_MPI=1).
#![cfg(feature = "mpi")]

mod common;

use std::path::Path;

use anyhow::Result;
use ft_params::weights::SafetensorsFiles;
use ft_trainer::train::ranks::train_as_ranks;

const BIN: &str = env!("CARGO_BIN_EXE_sdxl-ft");

/// The demo for `steps` steps as `np` ranks of `--accum accum` with `extra` flags in `out`: the
/// step losses, `None` without mpirun.
fn train(
    np: usize,
    accum: &str,
    steps: &str,
    extra: &[&str],
    out: &Path,
) -> Result<Option<Vec<f64>>> {
    let args = [
        "--demo",
        "--max-steps",
        steps,
        "--accum",
        accum,
        "--num-samples",
        "0",
        "--eval-images",
        "4",
    ];
    let args = [&args[..], extra].concat();
    Ok(train_as_ranks(np, BIN, &args, out)?)
}

#[test]
fn ranks_train_the_unet_one_process_trains_on_the_combined_batch() -> Result<()> {
    let dir = common::tmp("ranks");
    // Then 2 ranks under ZeRO-2: each rank updates half of the UNet's tensors and keeps the
    // EMA of that half; in bf16, each rank keeps the fp32 masters of its half. Then the fused backward (each block's
    // gradients summed over the ranks as its backward ends, clipped per tensor) against one
    // process's fused backward, without ZeRO and under ZeRO-2 (each block's sums reaching
    // their owners, which update them and send the weights after the backward).
    const FUSED: &[&str] = &["--fused-backward", "--checkpointing", "blocks"];
    let mut one_process = std::collections::HashMap::new();
    for (np, whole, zero, precision, mode) in [
        (2, "2", "0", "f32", &[][..]),
        (3, "3", "0", "f32", &[]),
        (2, "2", "2", "f32", &[]),
        (2, "2", "2", "bf16", &[]),
        (2, "2", "0", "bf16", FUSED),
        (2, "2", "2", "bf16", FUSED),
    ] {
        let fused = if mode.is_empty() { "" } else { "-fused" };
        let (one, many) = (
            dir.join(format!("one-{whole}-{precision}{fused}")),
            dir.join(format!("ranks-{np}-zero-{zero}-{precision}{fused}")),
        );
        if let std::collections::hash_map::Entry::Vacant(e) =
            one_process.entry((whole, precision, fused))
        {
            let flags = [&["--precision", precision][..], mode].concat();
            let Some(losses) = train(1, whole, "3", &flags, &one)? else {
                unreachable!("one process needs no mpirun")
            };
            e.insert(losses);
        }
        let expected = &one_process[&(whole, precision, fused)];
        let extra = [&["--zero", zero, "--precision", precision][..], mode].concat();
        let Some(got) = train(np, "1", "3", &extra, &many)? else {
            return Ok(());
        };
        assert_eq!(got.len(), 3);
        for (a, b) in got.iter().zip(expected) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{np} ranks, ZeRO-{zero}, {precision}{fused}: {got:?} vs {expected:?}"
            );
        }
        for unet in ["unet", "unet_ema"] {
            let file = |d: &Path| {
                SafetensorsFiles::open(&[d.join(format!(
                    "checkpoint-3/{unet}/diffusion_pytorch_model.safetensors"
                ))])
            };
            let (diff, name) = file(&many)?.max_difference(&file(&one)?, |_| true)?;
            assert!(
                diff <= 1e-5,
                "{np} ranks, ZeRO-{zero}, {precision}{fused}, {unet}: `{name}` differs by {diff}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The last evaluation's metrics of a run (rank 0's `metrics.jsonl`).
fn last_eval(dir: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl"))?;
    let line = text
        .lines()
        .rfind(|l| l.contains("\"eval_"))
        .ok_or_else(|| anyhow::anyhow!("{}: no evaluation", dir.display()))?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    Ok(v.as_object().cloned().unwrap_or_default())
}

/// The EMA's bytes in rank 0's ledger at its last row (`memory.jsonl`).
fn ema_bytes(dir: &Path) -> Result<u64> {
    let text = std::fs::read_to_string(dir.join("memory.jsonl"))?;
    let row: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or("{}"))?;
    Ok(row["told"]["ema"].as_u64().unwrap_or(0))
}

/// One process's checkpoint of step 3 (bf16 weights, fp32 masters, the EMA) resumed by 2 ranks
/// under ZeRO-2 to step 5 trains the UNet and the EMA one process trains to step 5: each rank
/// loads its share of the average. Rank 0 keeps about half of the EMA (one process: all of it),
/// evaluates with the whole (KID and CMMD of the demo's held-out images, its validation loss:
/// those of one process) and saves it whole.
#[test]
fn ranks_resume_one_process_keeping_a_share_of_the_ema_each() -> Result<()> {
    let dir = common::tmp("ranks-ema");
    let (one, many) = (dir.join("one"), dir.join("many"));
    let flags = ["--precision", "bf16", "--save-every", "3"];
    let Some(expected) = train(1, "2", "5", &flags, &one)? else {
        unreachable!("one process needs no mpirun")
    };
    let resume = one.join("checkpoint-3").display().to_string();
    let extra = [&flags[..], &["--zero", "2", "--resume", &resume]].concat();
    let Some(got) = train(2, "1", "5", &extra, &many)? else {
        return Ok(());
    };
    assert_eq!(got.len(), 2, "steps 4 and 5 after the resume: {got:?}");
    for (a, b) in got.iter().zip(&expected[3..]) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{got:?} vs {expected:?}");
    }
    for unet in ["unet", "unet_ema"] {
        let file = |d: &Path| {
            SafetensorsFiles::open(&[d.join(format!(
                "checkpoint-5/{unet}/diffusion_pytorch_model.safetensors"
            ))])
        };
        let (diff, name) = file(&many)?.max_difference(&file(&one)?, |_| true)?;
        assert!(diff <= 1e-5, "{unet}: `{name}` differs by {diff}");
    }
    let (a, b) = (last_eval(&many)?, last_eval(&one)?);
    for metric in ["eval_loss", "eval_kid_latent", "eval_cmmd_latent"] {
        let (x, y) = (a[metric].as_f64(), b[metric].as_f64());
        let (Some(x), Some(y)) = (x, y) else {
            panic!("{metric}: {a:?} vs {b:?}")
        };
        assert!(
            (x - y).abs() <= 1e-4 * y.abs().max(1.0),
            "{metric}: {x} vs {y}"
        );
    }
    let (share, whole) = (ema_bytes(&many)?, ema_bytes(&one)?);
    assert!(
        share > 0 && share as f64 <= 0.6 * whole as f64,
        "rank 0's EMA: {share} bytes, one process's {whole}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// An evaluation that needs no EMA (no samples, no MMD: the validation loss alone) tells the
/// other ranks so (`Ema::decline`), each evaluation of the run: 2 ranks under ZeRO-2 with the
/// EMA in shares evaluate after every step and train, evaluate and save what one process does
/// (were the others left waiting for shares rank 0 does not ask for, the run would hang until
/// `MPIEXEC_TIMEOUT` and fail).
#[test]
fn ranks_evaluate_without_the_ema_when_nothing_needs_it() -> Result<()> {
    let dir = common::tmp("ranks-ema-declined");
    let (one, many) = (dir.join("one"), dir.join("many"));
    let flags = ["--eval-mmd-samples", "0", "--eval-every", "1"];
    let Some(expected) = train(1, "2", "3", &flags, &one)? else {
        unreachable!("one process needs no mpirun")
    };
    let extra = [&flags[..], &["--zero", "2"]].concat();
    let Some(got) = train(2, "1", "3", &extra, &many)? else {
        return Ok(());
    };
    assert_eq!(got.len(), 3);
    for (a, b) in got.iter().zip(&expected) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{got:?} vs {expected:?}");
    }
    let evals = |d: &Path| -> Result<usize> {
        let text = std::fs::read_to_string(d.join("metrics.jsonl"))?;
        Ok(text.lines().filter(|l| l.contains("\"eval_loss\"")).count())
    };
    assert_eq!(evals(&many)?, 3, "an evaluation after each step");
    let (a, b) = (last_eval(&many)?, last_eval(&one)?);
    assert!(a.get("eval_kid_latent").is_none(), "no MMD: {a:?}");
    let (x, y) = (a["eval_loss"].as_f64(), b["eval_loss"].as_f64());
    assert!(
        matches!((x, y), (Some(x), Some(y)) if (x - y).abs() <= 1e-4 * y.abs().max(1.0)),
        "eval_loss: {x:?} vs {y:?}"
    );
    let file = |d: &Path| {
        SafetensorsFiles::open(&[
            d.join("checkpoint-3/unet_ema/diffusion_pytorch_model.safetensors")
        ])
    };
    let (diff, name) = file(&many)?.max_difference(&file(&one)?, |_| true)?;
    assert!(diff <= 1e-5, "unet_ema: `{name}` differs by {diff}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
