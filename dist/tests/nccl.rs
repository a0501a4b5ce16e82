//! The GPUs' collectives over NCCL (the `nccl` feature): one rank on one GPU here, and 2 ranks
//! on 2 GPUs under `mpirun` (with the `mpi` feature too) where a machine has them. Without a GPU
//! each test says so and passes, unless `FT_REQUIRE_GPU=1` (a GPU machine's check) makes that a
//! failure; with one GPU the 2-rank test says it needs two.
#![cfg(feature = "nccl")]

#[cfg(feature = "mpi")]
mod common;

use std::sync::Arc;

use anyhow::{bail, Context};
use ft_dist::cudarc::driver::{CudaContext, CudaStream};
use ft_dist::Comm;

/// GPU `ordinal`'s default stream, or why there is none (`Ok(None)`: the test is skipped).
fn stream(ordinal: usize) -> anyhow::Result<Option<Arc<CudaStream>>> {
    match CudaContext::new(ordinal) {
        Ok(ctx) => Ok(Some(ctx.default_stream())),
        Err(e) if std::env::var("FT_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            bail!("FT_REQUIRE_GPU=1 and GPU {ordinal} could not be opened: {e:?}")
        }
        Err(e) => {
            eprintln!("skipped: GPU {ordinal} could not be opened ({e:?})");
            Ok(None)
        }
    }
}

#[test]
fn one_rank_on_one_gpu() -> anyhow::Result<()> {
    let Some(s) = stream(0)? else { return Ok(()) };
    let c = Comm::solo();
    c.join_gpus(s.clone())?;
    let g = c.gpus().context("no NCCL communicator after join_gpus")?;
    assert_eq!((g.rank(), g.world()), (0, 1));
    let mut x = s.clone_htod(&[1.5f32, -2.0, 3.0])?;
    g.all_reduce_sum(&mut x)?;
    g.reduce_sum(&mut x, 0)?;
    g.broadcast(&mut x, 0)?;
    assert!(g.reduce_sum(&mut x, 1).is_err(), "a reduce to rank 1 of 1");
    assert_eq!(s.clone_dtoh(&x)?, [1.5, -2.0, 3.0]);
    Ok(())
}

/// Each rank on its host's GPU `local_rank`; run by each rank under `mpirun`.
#[cfg(feature = "mpi")]
#[test]
#[ignore = "run by each rank under mpirun: see two_ranks_on_two_gpus"]
fn gpu_rank_body() -> anyhow::Result<()> {
    let c = Comm::from_env()?;
    let (r, w) = (c.rank(), c.world());
    assert!(w > 1, "started outside mpirun");
    let s = stream(c.local_rank())?.context("no GPU for this rank")?;
    c.join_gpus(s.clone())?;
    let g = c.gpus().context("no NCCL communicator after join_gpus")?;
    assert_eq!((g.rank(), g.world()), (r, w));
    let tri = |n: usize| (n * (n + 1) / 2) as f32;

    let mut x = s.clone_htod(&[r as f32 + 1.0, 1.0])?;
    g.all_reduce_sum(&mut x)?;
    assert_eq!(s.clone_dtoh(&x)?, [tri(w), w as f32]);

    let mut y = s.clone_htod(&[r as f32 + 1.0, 2.0])?;
    g.reduce_sum(&mut y, w - 1)?;
    let want = if r == w - 1 {
        [tri(w), 2.0 * w as f32]
    } else {
        [r as f32 + 1.0, 2.0]
    };
    assert_eq!(s.clone_dtoh(&y)?, want);

    let mut z = s.clone_htod(&[r as f32; 3])?;
    g.broadcast(&mut z, w - 1)?;
    assert_eq!(s.clone_dtoh(&z)?, [(w - 1) as f32; 3]);
    c.barrier();
    common::finished(r)
}

#[cfg(feature = "mpi")]
#[test]
fn two_ranks_on_two_gpus() -> anyhow::Result<()> {
    let gpus = CudaContext::device_count().unwrap_or(0).max(0) as usize;
    if gpus < 2 {
        eprintln!("skipped: 2 ranks under NCCL need 2 GPUs; this machine has {gpus}");
        return Ok(());
    }
    common::ranks_run(2, "gpu_rank_body")?;
    Ok(())
}
