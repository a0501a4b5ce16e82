//! The GPUs' collectives over NCCL (the `nccl` feature): the gradient sums of a data-parallel run
//! whose ranks train on GPUs, summed where they are instead of through host memory.
//!
//! The ranks find each other through the host communicator: rank 0 makes NCCL's unique id and
//! broadcasts its 128 bytes over MPI (one process needs no exchange), then every rank joins the
//! NCCL communicator on its own GPU. Each collective is enqueued on the stream given at the
//! join (the candle device's), so it runs after the kernels that wrote its buffer and before
//! those that read it, without a host synchronisation.
//!
//! The library is `libnccl.so.2`, linked at build time and found at run time on the library
//! path: a system install, or the `nvidia-nccl-cu13` wheel (PyTorch's CUDA wheels depend on it).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtrMut};
use cudarc::nccl::safe::{Comm as NcclComm, Id, NcclType, ReduceOp};

use crate::comm::Comm;
use crate::error::{DistError, Result};

/// The length of NCCL's unique id (`NCCL_UNIQUE_ID_BYTES`).
const ID_BYTES: usize = 128;

/// One NCCL communicator over the ranks' GPUs, rank for rank the host communicator's.
pub struct Nccl {
    comm: NcclComm,
}

impl Nccl {
    /// Joins every rank of `host` to one NCCL communicator on `stream` (this rank's GPU): a
    /// collective, so every rank calls it, in the same place.
    pub(crate) fn join(host: &Comm, stream: Arc<CudaStream>) -> Result<Self> {
        let mut bytes = [0u8; ID_BYTES];
        if host.is_main() {
            let id = Id::new().map_err(|e| nccl_error("making NCCL's unique id", e))?;
            for (b, c) in bytes.iter_mut().zip(id.internal()) {
                *b = *c as u8;
            }
        }
        host.broadcast(&mut bytes, 0)?;
        let mut internal = [0 as std::ffi::c_char; ID_BYTES];
        for (c, b) in internal.iter_mut().zip(bytes) {
            *c = b as std::ffi::c_char;
        }
        // NCCL takes the GPU of the calling thread's current context: make it the stream's.
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| nccl_error("binding the stream's GPU to this thread", e))?;
        let comm = NcclComm::from_rank(stream, host.rank(), host.world(), Id::uninit(internal))
            .map_err(|e| {
                nccl_error(
                    &format!(
                        "joining the NCCL communicator as rank {} of {}",
                        host.rank(),
                        host.world()
                    ),
                    e,
                )
            })?;
        Ok(Nccl { comm })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world_size()
    }

    /// `buf` summed element by element over the ranks' GPUs, on every rank.
    pub fn all_reduce_sum<T: NcclType, B: DevicePtrMut<T>>(&self, buf: &mut B) -> Result<()> {
        self.comm
            .all_reduce_in_place(buf, &ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| nccl_error("all-reduce", e))
    }

    /// `buf` summed over the ranks into rank `root`'s `buf` alone (the others' are left as they
    /// were): ZeRO-2's gradient sums, each to the rank that steps it.
    pub fn reduce_sum<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        root: usize,
    ) -> Result<()> {
        self.check_root("reduce", root)?;
        self.comm
            .reduce_in_place(buf, &ReduceOp::Sum, root as i32)
            .map(|_| ())
            .map_err(|e| nccl_error("reduce", e))
    }

    /// Rank `root`'s `buf` in every rank's: ZeRO's updated weights, from the rank that stepped
    /// them, in the model's dtype (f32, bf16 or f16: `half`'s types are NCCL's too), into the
    /// weights' own buffer, which may be a view of a larger one.
    pub fn broadcast<T: NcclType, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        root: usize,
    ) -> Result<()> {
        self.check_root("broadcast", root)?;
        self.comm
            .broadcast_in_place(buf, root as i32)
            .map(|_| ())
            .map_err(|e| nccl_error("broadcast", e))
    }

    fn check_root(&self, op: &str, root: usize) -> Result<()> {
        if root >= self.world() {
            return Err(DistError::Shape(format!(
                "NCCL {op} to or from rank {root} in a world of {}",
                self.world()
            )));
        }
        Ok(())
    }
}

fn nccl_error(what: &str, e: impl std::fmt::Debug) -> DistError {
    DistError::Nccl(format!("{what}: {e:?}"))
}
