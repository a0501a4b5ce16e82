//! Data-parallel sdxl-ft under `mpirun` (#20): 2 ranks of `--accum 1` and 3 of `--accum 1`
//! train the UNet (and its EMA) that one process of `--accum 2` and `--accum 3` trains on the same
//! images, noise, timesteps, flips and caption dropout (drawn per micro-batch of the whole step),
//! within f32 rounding, also under ZeRO-2 and with the fused backward. Needs the `mpi` feature and `mpirun` (skipped, saying so, without one,
//! unless FT_REQUIRE_MPI=1).
#![cfg(feature = "mpi")]

mod common;

use std::path::Path;

use anyhow::Result;
use ft_params::weights::SafetensorsFiles;
use ft_trainer::train::ranks::train_as_ranks;

const BIN: &str = env!("CARGO_BIN_EXE_sdxl-ft");

/// The demo for 3 steps as `np` ranks of `--accum accum` with `extra` flags in `out`: the step
/// losses, `None` without mpirun.
fn train(np: usize, accum: &str, extra: &[&str], out: &Path) -> Result<Option<Vec<f64>>> {
    let args = [
        "--demo",
        "--max-steps",
        "3",
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
    // Then 2 ranks under ZeRO-2: each rank updates half of the UNet's tensors and rank 0's
    // EMA averages the weights the ranks sent; in bf16, each rank keeps the fp32 masters of
    // its half, rank 0 all of them for its EMA. Then the fused backward (each block's
    // gradients summed over the ranks as its backward ends, clipped per tensor) against one
    // process's fused backward.
    const FUSED: &[&str] = &["--fused-backward", "--checkpointing", "blocks"];
    let mut one_process = std::collections::HashMap::new();
    for (np, whole, zero, precision, mode) in [
        (2, "2", "0", "f32", &[][..]),
        (3, "3", "0", "f32", &[]),
        (2, "2", "2", "f32", &[]),
        (2, "2", "2", "bf16", &[]),
        (2, "2", "0", "bf16", FUSED),
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
            let Some(losses) = train(1, whole, &flags, &one)? else {
                unreachable!("one process needs no mpirun")
            };
            e.insert(losses);
        }
        let expected = &one_process[&(whole, precision, fused)];
        let extra = [&["--zero", zero, "--precision", precision][..], mode].concat();
        let Some(got) = train(np, "1", &extra, &many)? else {
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
