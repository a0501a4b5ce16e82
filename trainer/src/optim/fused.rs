//! Which updates the fused CUDA kernels take, and AdamW's kernel step with fp32 moments, which
//! 8-bit AdamW also uses for its small tensors.

use candle_core::{DType, Tensor, Var};

use super::adamw::AdamWConfig;
use crate::error::Result;

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

/// The scalars of AdamW's step `t` at learning rate `lr`, gradients multiplied by `grad_mul`,
/// for the CUDA kernels (not yet the first step of any moments; round-to-nearest weights).
pub(crate) fn cuda_step(
    c: &AdamWConfig,
    t: u64,
    lr: f64,
    grad_mul: f64,
) -> ft_kernels::cuda::AdamWStep {
    ft_kernels::cuda::AdamWStep {
        lr,
        beta1: c.beta1,
        beta2: c.beta2,
        eps: c.eps,
        weight_decay: c.weight_decay,
        step_size: lr / (1.0 - c.beta1.powi(t as i32)),
        bc2_sqrt: (1.0 - c.beta2.powi(t as i32)).sqrt(),
        grad_mul,
        first: false,
        seed: 0,
    }
}

/// One parameter's fused CUDA step with fp32 moments `m`, `v`, which are updated in place (or
/// created, before the first step, or copied into a contiguous fp32 layout when restored in
/// another): `p` an fp32 master, with the model weight `w` written when given, or a bf16/f16
/// weight without a master, updated in place.
pub(crate) fn fused_fp32_moments(
    p: &Var,
    g: &Tensor,
    m: &mut Option<Tensor>,
    v: &mut Option<Tensor>,
    w: Option<&Tensor>,
    base: &ft_kernels::cuda::AdamWStep,
) -> Result<()> {
    let g = g.detach().contiguous()?;
    let first = m.is_none() && v.is_none();
    let ok = |t: &Tensor| t.is_contiguous() && t.dtype() == DType::F32;
    let like = |t: &Option<Tensor>| -> Result<Tensor> {
        Ok(match t {
            Some(t) => t.to_dtype(DType::F32)?.contiguous()?.copy()?,
            None => Tensor::zeros(p.shape(), DType::F32, p.device())?,
        })
    };
    let (nm, nv) = match (&*m, &*v) {
        (Some(m), Some(v)) if ok(m) && ok(v) => (m.clone(), v.clone()),
        (m, v) => (like(m)?, like(v)?),
    };
    let step = ft_kernels::cuda::AdamWStep { first, ..*base };
    if p.dtype() == DType::F32 {
        ft_kernels::cuda::adamw_fused(p.as_tensor(), &nm, &nv, &g, w, &step)?;
    } else {
        ft_kernels::cuda::adamw_fused_in_place(p.as_tensor(), &nm, &nv, &g, &step)?;
    }
    *m = Some(nm);
    *v = Some(nv);
    Ok(())
}
