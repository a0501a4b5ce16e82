//! Data-parallel fewshot-ft under `mpirun` (#20): 2 ranks of `--accum 1` train the weights one
//! process of `--accum 2` trains on the same episodes, within f32 rounding, also under ZeRO-1
//! and ZeRO-2. Batch norm's running
//! statistics are the one difference, as in PyTorch's DDP: each rank's move with its own episodes
//! only (training normalises with each episode's own statistics, so the gradients do not see
//! them), and rank 0's are the ones it evaluates with and saves. Needs the `mpi` feature and
//! `mpirun` (skipped, saying so, without one, unless FT_REQUIRE_MPI=1).
#![cfg(feature = "mpi")]

use std::path::Path;

use anyhow::Result;
use ft_params::weights::SafetensorsFiles;
use ft_trainer::train::ranks::train_as_ranks;

const BIN: &str = env!("CARGO_BIN_EXE_fewshot-ft");

/// The demo for 3 steps as `np` ranks of `--accum accum` under ZeRO stage `zero` in `out`: the
/// step losses, `None` without mpirun.
fn train(np: usize, accum: &str, zero: &str, out: &Path) -> Result<Option<Vec<f64>>> {
    let args = [
        "--demo",
        "--max-steps",
        "3",
        "--accum",
        accum,
        "--val-episodes",
        "2",
        "--test-episodes",
        "4",
        "--zero",
        zero,
    ];
    Ok(train_as_ranks(np, BIN, &args, out)?)
}

#[test]
fn ranks_train_the_weights_one_process_trains_on_the_combined_episodes() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("fewshot-ranks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let one = dir.join("one");
    let Some(expected) = train(1, "2", "0", &one)? else {
        unreachable!("one process needs no mpirun")
    };
    for zero in ["0", "1", "2"] {
        let many = dir.join(format!("ranks-zero-{zero}"));
        let Some(got) = train(2, "1", zero, &many)? else {
            return Ok(());
        };
        assert_eq!(got.len(), 3);
        for (a, b) in got.iter().zip(&expected) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "ZeRO-{zero}: {got:?} vs {expected:?}"
            );
        }
        let file = |d: &Path| SafetensorsFiles::open(&[d.join("checkpoint-3/model.safetensors")]);
        let (a, b) = (file(&many)?, file(&one)?);
        let weights = |n: &str| !n.contains("running_");
        let (diff, name) = a.max_difference(&b, weights)?;
        assert!(diff <= 1e-5, "ZeRO-{zero}: `{name}` differs by {diff}");
        // The running statistics: rank 0's episodes only, not all of them.
        let (diff, name) = a.max_difference(&b, |n| !weights(n))?;
        assert!(
            diff > 1e-6,
            "ZeRO-{zero}: running statistics equal (`{name}`)"
        );
        assert!(many.join("results.json").is_file());
    }
    assert!(one.join("results.json").is_file());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
