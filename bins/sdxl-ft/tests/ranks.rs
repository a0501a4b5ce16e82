//! Data-parallel sdxl-ft under `mpirun` (#20): 2 ranks of `--accum 1` and 3 of `--accum 1`
//! train the UNet (and its EMA) that one process of `--accum 2` and `--accum 3` trains on the same
//! images, noise, timesteps, flips and caption dropout (drawn per micro-batch of the whole step),
//! within f32 rounding. Needs the `mpi` feature and `mpirun` (skipped, saying so, without one,
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
    // its half, rank 0 all of them for its EMA.
    let mut one_process = std::collections::HashMap::new();
    for (np, whole, zero, precision) in [
        (2, "2", "0", "f32"),
        (3, "3", "0", "f32"),
        (2, "2", "2", "f32"),
        (2, "2", "2", "bf16"),
    ] {
        let (one, many) = (
            dir.join(format!("one-{whole}-{precision}")),
            dir.join(format!("ranks-{np}-zero-{zero}-{precision}")),
        );
        if let std::collections::hash_map::Entry::Vacant(e) = one_process.entry((whole, precision))
        {
            let Some(losses) = train(1, whole, &["--precision", precision], &one)? else {
                unreachable!("one process needs no mpirun")
            };
            e.insert(losses);
        }
        let expected = &one_process[&(whole, precision)];
        let extra = ["--zero", zero, "--precision", precision];
        let Some(got) = train(np, "1", &extra, &many)? else {
            return Ok(());
        };
        assert_eq!(got.len(), 3);
        for (a, b) in got.iter().zip(expected) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{np} ranks, ZeRO-{zero}, {precision}: {got:?} vs {expected:?}"
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
                "{np} ranks, ZeRO-{zero}, {precision}, {unet}: `{name}` differs by {diff}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
