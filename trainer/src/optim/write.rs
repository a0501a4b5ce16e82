//! Writing updated weights: an fp32 value into a parameter of any dtype (rounded to nearest, or
//! stochastically for bf16 weights without masters), and updated masters into the model weights
//! they shadow.

use candle_core::{DType, Tensor, Var};

use crate::error::Result;

/// Writes the updated fp32 values `w` into parameter `p` (index `i`) at step `t`: cast to its
/// dtype, or for a bf16 parameter with a stochastic-rounding seed rounded stochastically from a
/// stream of its own.
pub(crate) fn write_param(p: &Var, w: &Tensor, sr: Option<u64>, t: u64, i: usize) -> Result<()> {
    let w = match (p.dtype(), sr) {
        (DType::BF16, Some(seed)) => {
            ft_kernels::rounding::round_stochastic_bf16(w, rounding_seed(seed, t, i))?
        }
        (dt, _) => w.to_dtype(dt)?,
    };
    p.set(&w)?;
    Ok(())
}

/// The stochastic-rounding seed of parameter `i` at step `t` from the optimizer's `seed`: a
/// stream of its own per step and parameter (the element index is hashed in by the rounding),
/// the same on the CPU and in the fused CUDA update.
pub(crate) fn rounding_seed(seed: u64, t: u64, i: usize) -> u64 {
    let mut r = ft_params::rng::SplitMix64::new(seed ^ t.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let stream = r.next_u64() ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    // 0 means "to nearest" to the CUDA kernel.
    ft_params::rng::SplitMix64::new(stream).next_u64().max(1)
}

/// The seed a fused CUDA update rounds parameter `p` (index `i`, step `t`) with: a bf16 weight
/// without a master is rounded stochastically in the kernel from the stream [`write_param`]
/// would use on the CPU (`sr` the optimizer's seed); 0 (to nearest) for anything else.
#[cfg(feature = "cuda")]
pub(crate) fn kernel_seed(p: &Var, sr: Option<u64>, t: u64, i: usize) -> u64 {
    match (p.dtype(), sr) {
        (DType::BF16, Some(s)) => rounding_seed(s, t, i),
        _ => 0,
    }
}

/// Writes each updated master into the model weight it shadows: rounded to the weight's dtype
/// on the master's device first, so an offloaded step moves 2 bytes per bf16 weight, not 4.
/// Only parameters that got a gradient were updated, and only they are written.
pub(crate) fn write_back(params: &[Var], model: &[Var], grads: &[Option<Tensor>]) -> Result<()> {
    for ((m, p), g) in model.iter().zip(params).zip(grads) {
        if g.is_some() {
            write_master(p, m)?;
        }
    }
    Ok(())
}

/// Writes the master `p` (fp32 values) into the model weight `m` it shadows (see
/// [`write_back`]).
fn write_master(p: &Tensor, m: &Var) -> Result<()> {
    let w = match ft_kernels::host::narrowed(p, m.dtype()) {
        Some(w) => w?,
        None => p.to_dtype(m.dtype())?,
    };
    m.set(&w.to_device(m.device())?)?;
    Ok(())
}

/// A gradient as the update of `p` reads it: fp32, on `p`'s device (the host, when the
/// optimizer state is offloaded; a no-op move otherwise), detached from its graph.
pub(crate) fn grad_for(p: &Var, g: &Tensor) -> Result<Tensor> {
    Ok(g.to_device(p.device())?.to_dtype(DType::F32)?.detach())
}

/// Writes the updated masters into the model weights, unless the update wrote them itself.
pub(crate) fn finish(
    params: &[Var],
    grads: &[Option<Tensor>],
    model: Option<&[Var]>,
    written: bool,
) -> Result<()> {
    match model {
        Some(m) if !written => write_back(params, m, grads),
        _ => Ok(()),
    }
}
