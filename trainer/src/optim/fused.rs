//! Which updates the fused CUDA kernels take: every stepped parameter a contiguous CUDA tensor
//! of a dtype they read, and whether they can write the model weights in the same pass.

use candle_core::{DType, Tensor, Var};

/// Whether the fused CUDA kernels can update `p` from an fp32 master (or as an fp32 weight):
/// contiguous fp32 on CUDA.
fn fusable_master(p: &Var) -> bool {
    p.device().is_cuda() && p.dtype() == DType::F32 && p.as_tensor().is_contiguous()
}

/// Whether the fused CUDA kernels can update `p` in place without a master (`--full-bf16`):
/// contiguous bf16/f16 on CUDA.
fn fusable_in_place(p: &Var) -> bool {
    p.device().is_cuda()
        && matches!(p.dtype(), DType::BF16 | DType::F16)
        && p.as_tensor().is_contiguous()
}

/// Whether an update takes the fused CUDA kernels, and which model weights they write in the
/// same pass: `None` off the kernels (the kernels turned off, or a parameter given a gradient
/// that is not a contiguous CUDA tensor they take); `Some(Some(model))` where the kernels write
/// `model` too; `Some(None)` where there is no model or they cannot write it (`write::finish`
/// then does). Only the parameters given a gradient are looked at: a fused backward pass updates one
/// at a time, and looking at all 1,680 of the SDXL UNet's for each would be quadratic.
pub(crate) fn fused_path<'a>(
    params: &[Var],
    grads: &[Option<Tensor>],
    model: Option<&'a [Var]>,
) -> Option<Option<&'a [Var]>> {
    if !ft_kernels::cuda::enabled() {
        return None;
    }
    let stepped = || {
        params
            .iter()
            .zip(grads)
            .enumerate()
            .filter(|(_, (_, g))| g.is_some())
            .map(|(i, (p, _))| (i, p))
    };
    if stepped().all(|(_, p)| fusable_master(p)) {
        let writable = |m: &&[Var]| {
            m.len() == params.len() && stepped().all(|(i, _)| m[i].as_tensor().is_contiguous())
        };
        return Some(model.filter(writable));
    }
    (model.is_none() && stepped().all(|(_, p)| fusable_in_place(p))).then_some(None)
}
