//! Per-parameter state as checkpoints name it (`exp_avg.3`), and the one check that an update
//! got the lists the optimizer was built for.

use candle_core::{DType, Tensor, Var};

use crate::error::{Error, Result};

/// The one error for an update given other lists than the optimizer was built for.
pub(crate) fn check_len(params: &[Var], grads: &[Option<Tensor>], state: usize) -> Result<()> {
    if params.len() != grads.len() || params.len() != state {
        return Err(Error::Invalid(format!(
            "optimizer built for {state} parameters got {} parameters and {} gradients",
            params.len(),
            grads.len()
        )));
    }
    Ok(())
}

/// `{prefix}.{i}` for each slot that holds a tensor.
pub(crate) fn state_tensors(prefix: &str, v: &[Option<Tensor>]) -> Vec<(String, Tensor)> {
    named_state(&[prefix], v, |t, _| t.as_ref())
}

/// Checkpoint entries `{kind}.{i}` of per-parameter state: for each of `kinds` in order, the
/// tensor `part(slot, k)` (the k-th kind) of every parameter that has one. They share storage
/// with the live state (see [`super::Optimizer::state`]).
pub(crate) fn named_state<S>(
    kinds: &[&str],
    slots: &[S],
    part: impl Fn(&S, usize) -> Option<&Tensor>,
) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    for (k, kind) in kinds.iter().enumerate() {
        for (i, s) in slots.iter().enumerate() {
            if let Some(t) = part(s, k) {
                out.push((format!("{kind}.{i}"), t.clone()));
            }
        }
    }
    out
}

/// A checkpoint entry's name `{kind}.{i}` split and checked against `n` parameters: `None` for
/// a name without an index (not per-parameter state).
pub(crate) fn state_name(name: &str, n: usize) -> Result<Option<(&str, usize)>> {
    let Some((kind, idx)) = name.rsplit_once('.') else {
        return Ok(None);
    };
    let i: usize = idx
        .parse()
        .map_err(|_| Error::Invalid(format!("optimizer state `{name}`: bad index")))?;
    if i >= n {
        return Err(Error::Invalid(format!(
            "optimizer state `{name}`: no parameter {i} of {n}"
        )));
    }
    Ok(Some((kind, i)))
}

/// A checkpoint's per-parameter state named `{prefix}.{i}` restored into `slots`: fp32 copies of
/// their own (8-bit moments are refused with the flag that resumes them).
pub(crate) fn load_slot(
    prefix: &str,
    slots: &mut [Option<Tensor>],
    tensors: &[(String, Tensor)],
) -> Result<()> {
    let n = slots.len();
    for (name, t) in tensors {
        if name
            .rsplit_once('.')
            .is_some_and(|(kind, _)| kind == prefix)
        {
            let Some((_, i)) = state_name(name, n)? else {
                continue;
            };
            let slot = &mut slots[i];
            if t.dtype() == DType::U8 {
                return Err(Error::Invalid(format!(
                    "optimizer state `{name}` holds 8-bit moments: resume with --optim adamw8bit"
                )));
            }
            // A copy of its own: the fused CUDA step and AdamW's host pass update moments in
            // place, which must not reach the caller's tensor (`to_dtype` to the same dtype
            // shares its storage).
            *slot = Some(t.to_dtype(DType::F32)?.copy()?);
        }
    }
    Ok(())
}
