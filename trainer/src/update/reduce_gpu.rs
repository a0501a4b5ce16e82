//! A bucket of gradients summed over the ranks' GPUs under NCCL (the `nccl` feature), where the
//! host path ([`super::reduce`]) copies each bucket to host memory, sums it over MPI and copies
//! it back: here the bucket is one fp32 tensor on the GPU, summed in place on candle's stream.
//! Also ZeRO's updated weights, sent by their owner into the other ranks' weights on the GPU
//! ([`broadcast_weight`]), where the host path copies them out and back in.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Tensor};
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
    flat.inplace_op1(&Sum { nccl, root })?;
    Ok(flat)
}

/// The in-place sum of one contiguous fp32 buffer over the ranks' GPUs.
struct Sum<'a> {
    nccl: &'a Nccl,
    root: Option<usize>,
}

impl candle_core::InplaceOp1 for Sum<'_> {
    fn name(&self) -> &'static str {
        "nccl-sum"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("NCCL sums tensors on a GPU; this bucket is in host memory")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let n = l.shape().elem_count();
        let buf = s.as_cuda_slice_mut::<f32>()?;
        if !l.is_contiguous() || l.start_offset() != 0 || buf.len() != n {
            candle_core::bail!(
                "nccl-sum: a bucket of {n} values in a buffer of {} at offset {}",
                buf.len(),
                l.start_offset()
            )
        }
        match self.root {
            None => self.nccl.all_reduce_sum(buf),
            Some(r) => self.nccl.reduce_sum(buf, r),
        }
        .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// Rank `root`'s values of `weight` (a tensor on the GPU: a model weight's) written into every
/// rank's `weight`, in place and in its own dtype: ZeRO's updated weights from their owner,
/// which never leave the GPUs.
pub(super) fn broadcast_weight(nccl: &Nccl, weight: &Tensor, root: usize) -> Result<()> {
    weight.inplace_op1(&Broadcast { nccl, root })?;
    Ok(())
}

/// The in-place broadcast of one contiguous buffer (f32, bf16 or f16) from rank `root`.
struct Broadcast<'a> {
    nccl: &'a Nccl,
    root: usize,
}

impl candle_core::InplaceOp1 for Broadcast<'_> {
    fn name(&self) -> &'static str {
        "nccl-broadcast"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("NCCL moves tensors on a GPU; this weight is in host memory")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("nccl-broadcast: a weight laid out with gaps ({l:?})")
        };
        let sent = match s.dtype() {
            DType::F32 => self.fill(s.as_cuda_slice_mut::<f32>()?, start, end),
            DType::BF16 => self.fill(s.as_cuda_slice_mut::<half::bf16>()?, start, end),
            DType::F16 => self.fill(s.as_cuda_slice_mut::<half::f16>()?, start, end),
            other => candle_core::bail!("nccl-broadcast: a {other:?} weight"),
        };
        sent.map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

impl Broadcast<'_> {
    /// The broadcast into `buf`'s values `start..end` (the weight's, where its buffer is larger).
    fn fill<T: ft_dist::cudarc::nccl::safe::NcclType>(
        &self,
        buf: &mut ft_dist::cudarc::driver::CudaSlice<T>,
        start: usize,
        end: usize,
    ) -> ft_dist::Result<()> {
        if start == 0 && end == buf.len() {
            return self.nccl.broadcast(buf, self.root);
        }
        self.nccl
            .broadcast(&mut buf.slice_mut(start..end), self.root)
    }
}
