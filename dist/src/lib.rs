//! Collectives between the processes of one training run.
//!
//! A run started by `mpirun`, `srun` or `torchrun` learns its rank, world size and local rank
//! from the launcher's environment ([`Launch`]), and talks to the other ranks through a [`Comm`]:
//! all-reduce, reduce-scatter, all-gather, broadcast and barrier on plain slices, and
//! [`Comm::agree`], which stops every rank with the same error when their configurations
//! differ. Without the `mpi` feature a binary is one process ([`Comm::solo`]) and a launch of
//! several is an error that says how to build for it; with it, the ranks talk through MPI.
//! With the `nccl` feature the ranks' GPUs also join one NCCL communicator
//! ([`Comm::join_gpus`]), over which tensors on the GPU are summed where they are.

mod comm;
mod element;
mod error;
mod launch;
#[cfg(feature = "mpi")]
mod mpi_backend;
mod mpirun;
#[cfg(feature = "nccl")]
mod nccl_backend;

pub use comm::Comm;
/// The CUDA bindings the NCCL side takes its buffers and streams in (the version candle uses).
#[cfg(feature = "nccl")]
pub use cudarc;
pub use element::Element;
pub use error::{DistError, Result};
pub use launch::Launch;
pub use mpirun::{mpirun, ranks_of, RanksCommand};
#[cfg(feature = "nccl")]
pub use nccl_backend::Nccl;
