//! The ranks' collectives on tensors on their GPUs under NCCL (the `nccl` feature), where the
//! host path copies each buffer to host memory, runs it over MPI and copies it back: a bucket
//! of gradients summed as one fp32 tensor ([`sum_parts`], beside [`super::reduce`]), and ZeRO's
//! updated weights sent by their owner into the other ranks' weights ([`broadcast_weight`]).
//! Each runs in place on candle's stream, as one [`OnGpu`] op.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Tensor};
use ft_dist::cudarc::driver::{CudaSlice, DevicePtrMut};
use ft_dist::cudarc::nccl::safe::NcclType;
use ft_dist::Nccl;

use crate::error::Result;

/// `parts` (flat fp32 tensors on the GPU, one a parameter, in the bucket's order) as one
/// tensor summed over the ranks: on every rank (`root` None) or on rank `root` alone (the
/// others' tensor then holds their own values). A fresh buffer: the parts are left as they are.
pub(super) fn sum_parts(nccl: &Nccl, parts: &[Tensor], root: Option<usize>) -> Result<Tensor> {
    let flat = match parts {
        // `cat` of one tensor is that tensor; the sum is written in place, so copy it, into a
        // buffer of its own values alone (`copy` keeps a view's offset and the whole buffer).
        [one] => one.force_contiguous()?,
        _ => Tensor::cat(parts, 0)?,
    };
    let what = match root {
        None => Collective::SumEverywhere,
        Some(r) => Collective::SumTo(r),
    };
    flat.inplace_op1(&OnGpu { nccl, what })?;
    Ok(flat)
}

/// Rank `root`'s values of `weight` (a tensor on the GPU: a model weight's) written into every
/// rank's `weight`, in place and in its own dtype: ZeRO's updated weights from their owner,
/// which never leave the GPUs.
pub(super) fn broadcast_weight(nccl: &Nccl, weight: &Tensor, root: usize) -> Result<()> {
    let what = Collective::From(root);
    weight.inplace_op1(&OnGpu { nccl, what })?;
    Ok(())
}

/// Which collective an [`OnGpu`] op runs.
#[derive(Clone, Copy)]
enum Collective {
    /// Summed over the ranks, on every rank.
    SumEverywhere,
    /// Summed over the ranks onto this rank alone.
    SumTo(usize),
    /// This rank's values, on every rank.
    From(usize),
}

/// One NCCL collective in place on a tensor's values (f32, bf16 or f16), which may start
/// inside a larger buffer but must lie in one contiguous run.
struct OnGpu<'a> {
    nccl: &'a Nccl,
    what: Collective,
}

impl candle_core::InplaceOp1 for OnGpu<'_> {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("NCCL runs on tensors on a GPU; this one is in host memory")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("nccl: a tensor laid out with gaps ({l:?})")
        };
        let done = match s.dtype() {
            DType::F32 => self.run(s.as_cuda_slice_mut::<f32>()?, start, end),
            DType::BF16 => self.run(s.as_cuda_slice_mut::<half::bf16>()?, start, end),
            DType::F16 => self.run(s.as_cuda_slice_mut::<half::f16>()?, start, end),
            other => candle_core::bail!("nccl: a {other:?} tensor (f32, bf16 or f16)"),
        };
        done.map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

impl OnGpu<'_> {
    /// The collective on `buf`'s values `start..end` (the tensor's, where its buffer is larger).
    fn run<T: NcclType>(
        &self,
        buf: &mut CudaSlice<T>,
        start: usize,
        end: usize,
    ) -> ft_dist::Result<()> {
        if start == 0 && end == buf.len() {
            return self.on(buf);
        }
        self.on(&mut buf.slice_mut(start..end))
    }

    fn on<T: NcclType, B: DevicePtrMut<T>>(&self, buf: &mut B) -> ft_dist::Result<()> {
        match self.what {
            Collective::SumEverywhere => self.nccl.all_reduce_sum(buf),
            Collective::SumTo(r) => self.nccl.reduce_sum(buf, r),
            Collective::From(r) => self.nccl.broadcast(buf, r),
        }
    }
}

/// For the GPU tests: GPU 0 and one process's communicator, its GPU joined to NCCL (a world of
/// one), or None without a GPU (`gpu()` makes that a failure under `FT_REQUIRE_GPU=1`).
#[cfg(test)]
pub(super) fn joined_gpu() -> Result<Option<(candle_core::Device, ft_dist::Comm)>> {
    let Some(device) = ft_kernels::cuda::check::gpu() else {
        return Ok(None);
    };
    let candle_core::Device::Cuda(d) = &device else {
        return Err(crate::error::Error::Invalid(
            "gpu() gave another device".into(),
        ));
    };
    let comm = ft_dist::Comm::solo();
    comm.join_gpus(d.cuda_stream())?;
    Ok(Some((device, comm)))
}
