//! A step's gradients summed over the ranks of a data-parallel run, before the update: on every
//! rank (all-reduce), or each parameter's on the rank that steps it alone (ZeRO-2, [`super::zero`]).
//!
//! Each rank's accumulator holds the sum over its own micro-batches, each already divided by the
//! units (tokens or samples) of the whole step on all ranks, so the sum over the ranks is the
//! gradient one process would get from all the micro-batches: the ranks then take the same
//! update. The sums travel in fp32 through the host, in buckets of at most [`BUCKET`] values
//! (fewer, larger messages than one a tensor; a tensor larger than a bucket goes alone).

use candle_core::{DType, Device, Tensor, Var};
use ft_dist::Comm;

use crate::error::{Error, Result};

/// Values a message carries at most (16 MiB of fp32) unless one tensor is larger.
pub(super) const BUCKET: usize = 4 << 20;

/// `grads` (one entry per parameter of `params`, `None` for a parameter without a gradient)
/// summed over the ranks of `comm`, as fp32 tensors on `device`. A parameter keeps `None` only
/// when no rank has a gradient for it (as one process skips it); a rank without one adds zeros.
/// The identity for a world of one.
pub fn all_reduce_gradients(
    comm: &Comm,
    grads: Vec<Option<Tensor>>,
    params: &[Var],
    device: &Device,
) -> Result<Vec<Option<Tensor>>> {
    if comm.world() == 1 {
        return Ok(grads);
    }
    Ok(sum_gradients(comm, grads, params, device, None, &mut [])?.0)
}

/// One round of a fused backward pass over several ranks ([`super::MixedOptimizer::backward_and_step_across`]):
/// the gradients this rank offers now (a segment's, as its backward ends; after the backward,
/// the rest), summed over the ranks with every rank's offer of this round, as `(index, fp32
/// sum on device)` for each parameter some rank offered. `finished` says this rank's backward
/// has ended; the second value, that every rank's has, so that a rank whose backward ended
/// (or that had no micro-batch) keeps answering rounds, offering nothing, until the last one.
pub(super) fn sum_round(
    comm: &Comm,
    offered: Vec<(usize, Tensor)>,
    finished: bool,
    params: &[Var],
    device: &Device,
) -> Result<(Vec<(usize, Tensor)>, bool)> {
    let mut grads: Vec<Option<Tensor>> = vec![None; params.len()];
    for (i, g) in offered {
        let slot = grads.get_mut(i).ok_or_else(|| {
            Error::Invalid(format!(
                "parameter {i} of {}: no such parameter",
                params.len()
            ))
        })?;
        *slot = Some(g);
    }
    let mut done = [finished as u64];
    let (sums, _) = sum_gradients(comm, grads, params, device, None, &mut done)?;
    let sums = sums
        .into_iter()
        .enumerate()
        .filter_map(|(i, g)| Some((i, g?)))
        .collect();
    Ok((sums, done[0] == comm.world() as u64))
}

/// As [`all_reduce_gradients`], but each parameter's sum reaches only the rank `owner[i]` (the
/// others get `None` for it): ZeRO-2's partitioned gradients. Also returns which parameters had
/// a gradient on some rank (what the owners then update).
pub(super) fn reduce_gradients_to_owners(
    comm: &Comm,
    grads: Vec<Option<Tensor>>,
    params: &[Var],
    device: &Device,
    owner: &[usize],
) -> Result<(Vec<Option<Tensor>>, Vec<bool>)> {
    if comm.world() == 1 {
        let present = grads.iter().map(Option::is_some).collect();
        return Ok((grads, present));
    }
    sum_gradients(comm, grads, params, device, Some(owner), &mut [])
}

/// The sums over the ranks, to every rank (`owner` None) or to each parameter's owner, bucket
/// by bucket (with owners, each bucket holds one owner's parameters), and which parameters had
/// a gradient on some rank. `counts` are summed over the ranks in the same message as which
/// parameters each rank has.
fn sum_gradients(
    comm: &Comm,
    mut grads: Vec<Option<Tensor>>,
    params: &[Var],
    device: &Device,
    owner: Option<&[usize]>,
    counts: &mut [u64],
) -> Result<(Vec<Option<Tensor>>, Vec<bool>)> {
    if grads.len() != params.len() || owner.is_some_and(|o| o.len() != params.len()) {
        return Err(Error::Invalid(format!(
            "{} gradients for {} parameters",
            grads.len(),
            params.len()
        )));
    }
    // Which parameters have a gradient on some rank: all ranks must reduce the same ones.
    let mut present: Vec<u64> = grads.iter().map(|g| g.is_some() as u64).collect();
    present.extend_from_slice(counts);
    comm.all_reduce_sum(&mut present)?;
    counts.copy_from_slice(&present[grads.len()..]);
    present.truncate(grads.len());
    let present: Vec<bool> = present.iter().map(|&p| p > 0).collect();
    let roots: Vec<Option<usize>> = match owner {
        None => vec![None],
        Some(_) => (0..comm.world()).map(Some).collect(),
    };
    let mut out: Vec<Option<Tensor>> = vec![None; grads.len()];
    let mut bucket = Bucket::default();
    for root in roots {
        for i in 0..grads.len() {
            if !present[i] || root.is_some_and(|r| owner.is_some_and(|o| o[i] != r)) {
                continue;
            }
            let n = params[i].elem_count();
            if !bucket.values.is_empty() && bucket.values.len() + n > BUCKET {
                bucket.flush(comm, root, params, device, &mut out)?;
            }
            match grads[i].take() {
                Some(g) => {
                    if g.elem_count() != n {
                        return Err(Error::Invalid(format!(
                            "parameter {i}: a gradient of {} values for {n}",
                            g.elem_count()
                        )));
                    }
                    let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    bucket.values.extend(g);
                }
                None => bucket.values.resize(bucket.values.len() + n, 0.0),
            }
            bucket.members.push(i);
        }
        bucket.flush(comm, root, params, device, &mut out)?;
    }
    Ok((out, present))
}

/// The values of the parameters `members`, one after the other, on their way to a collective.
#[derive(Default)]
struct Bucket {
    values: Vec<f32>,
    members: Vec<usize>,
}

impl Bucket {
    /// Sums the values over the ranks (into `root` alone, when given) and, where the sum
    /// arrived, puts each member's part back as its parameter's gradient.
    fn flush(
        &mut self,
        comm: &Comm,
        root: Option<usize>,
        params: &[Var],
        device: &Device,
        out: &mut [Option<Tensor>],
    ) -> Result<()> {
        if self.members.is_empty() {
            return Ok(());
        }
        match root {
            None => comm.all_reduce_sum(&mut self.values)?,
            Some(r) => comm.reduce_sum(&mut self.values, r)?,
        }
        if root.is_none_or(|r| r == comm.rank()) {
            let mut at = 0;
            for &i in &self.members {
                let n = params[i].elem_count();
                let part = self.values.get(at..at + n).ok_or_else(|| {
                    Error::Invalid(format!("parameter {i}: the reduced bucket is short"))
                })?;
                out[i] = Some(Tensor::from_slice(part, params[i].shape(), device)?);
                at += n;
            }
        }
        self.values.clear();
        self.members.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rank_keeps_the_gradients_as_they_are() -> Result<()> {
        let p = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let g = Tensor::new(&[0.5f32, -1.0], &Device::Cpu)?.to_dtype(DType::BF16)?;
        let params = [p.clone(), p];
        let out = all_reduce_gradients(
            &Comm::solo(),
            vec![Some(g.clone()), None],
            &params,
            &Device::Cpu,
        )?;
        assert_eq!(out[0].as_ref().map(|t| t.dtype()), Some(DType::BF16));
        assert!(out[1].is_none());
        let (out, present) = reduce_gradients_to_owners(
            &Comm::solo(),
            vec![Some(g), None],
            &params,
            &Device::Cpu,
            &[0, 0],
        )?;
        assert_eq!(present, [true, false]);
        assert!(out[0].is_some() && out[1].is_none());
        Ok(())
    }
}
