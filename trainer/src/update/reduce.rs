//! A step's gradients summed over the ranks of a data-parallel run, before the update: on every
//! rank (all-reduce), or each parameter's on the rank that steps it alone (ZeRO-2, [`super::zero`]).
//!
//! Each rank's accumulator holds the sum over its own micro-batches, each already divided by the
//! units (tokens or samples) of the whole step on all ranks, so the sum over the ranks is the
//! gradient one process would get from all the micro-batches: the ranks then take the same
//! update. The sums travel in fp32, in buckets of at most [`BUCKET`] values (fewer, larger
//! messages than one a tensor; a tensor larger than a bucket goes alone): through host memory
//! over the host communicator, or, for gradients on a GPU whose ranks joined NCCL (the `nccl`
//! feature, [`ft_dist::Comm::join_gpus`]), on the GPU ([`super::reduce_gpu`]).

use candle_core::{DType, Device, Tensor, Var};
use ft_dist::Comm;

use crate::error::{Error, Result};

/// Values a message carries at most (16 MiB of fp32) unless one tensor is larger.
pub(super) const BUCKET: usize = 4 << 20;

/// The most values one bucket holds at once for parameters of `sizes` values: a bucket's worth,
/// or the largest parameter where it is larger, and never more than all of them.
pub(crate) fn bucket_values(sizes: impl Iterator<Item = usize> + Clone) -> usize {
    let largest = sizes.clone().max().unwrap_or(0);
    let total: usize = sizes.sum();
    total.min(BUCKET.max(largest))
}

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
    Ok(sum_gradients(comm, grads, params, device, None, &mut [], &mut none)?.0)
}

/// One round of a backward pass over several ranks ([`super::rounds`]): the gradients this
/// rank offers now (a segment's, as its backward ends; after the backward, the rest), summed
/// over the ranks with every rank's offer of this round, as `(index, fp32 sum on device)` for
/// each parameter some rank offered (under ZeRO, `owner` given: for each this rank owns, the
/// others' sums reaching their owners alone). Also which parameters some rank offered (summed
/// in this round), whether every rank's backward has ended (`finished` says this rank's has,
/// so that a rank whose backward ended, or that had no micro-batch, keeps answering rounds,
/// offering nothing, until the last one), and whether some rank's backward failed (`failed`
/// says this one's has: the others then stop theirs and answer until the last round). For a
/// parameter another rank offers and this one does not, `fill` gives what this rank adds (its
/// sum of the step's earlier micro-batches, when it holds one), else zeros.
#[allow(clippy::too_many_arguments)]
pub(super) fn sum_round(
    comm: &Comm,
    offered: Vec<(usize, Tensor)>,
    finished: bool,
    failed: bool,
    params: &[Var],
    device: &Device,
    owner: Option<&[usize]>,
    fill: &mut dyn FnMut(usize) -> Option<Tensor>,
) -> Result<Round> {
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
    let mut flags = [finished as u64, failed as u64];
    let (sums, summed) = sum_gradients(comm, grads, params, device, owner, &mut flags, fill)?;
    let sums = sums
        .into_iter()
        .enumerate()
        .filter_map(|(i, g)| Some((i, g?)))
        .collect();
    Ok(Round {
        sums,
        summed,
        all_finished: flags[0] == comm.world() as u64,
        failed: flags[1] > 0,
    })
}

/// What one round of a backward over several ranks gives this rank ([`sum_round`]).
pub(super) struct Round {
    /// The sums that reach this rank.
    pub sums: Vec<(usize, Tensor)>,
    /// Which parameters some rank offered in the round.
    pub summed: Vec<bool>,
    /// Whether every rank's backward has ended.
    pub all_finished: bool,
    /// Whether some rank's backward failed (its own error, or one it saw in an earlier round).
    pub failed: bool,
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
    sum_gradients(comm, grads, params, device, Some(owner), &mut [], &mut none)
}

/// What a rank adds for a parameter it has no gradient of: zeros.
fn none(_: usize) -> Option<Tensor> {
    None
}

/// The sums over the ranks, to every rank (`owner` None) or to each parameter's owner, bucket
/// by bucket (with owners, each bucket holds one owner's parameters), and which parameters had
/// a gradient on some rank. `counts` are summed over the ranks in the same message as which
/// parameters each rank has. A parameter some rank has and this one has not takes `fill`'s
/// tensor for it, or zeros.
fn sum_gradients(
    comm: &Comm,
    mut grads: Vec<Option<Tensor>>,
    params: &[Var],
    device: &Device,
    owner: Option<&[usize]>,
    counts: &mut [u64],
    fill: &mut dyn FnMut(usize) -> Option<Tensor>,
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
    // In this round, beside the rank that has it: what this rank holds of it (see `fill`).
    for (i, g) in grads.iter_mut().enumerate() {
        if present[i] && g.is_none() {
            *g = fill(i);
        }
    }
    let roots: Vec<Option<usize>> = match owner {
        None => vec![None],
        Some(_) => (0..comm.world()).map(Some).collect(),
    };
    let mut out: Vec<Option<Tensor>> = vec![None; grads.len()];
    let mut bucket = Bucket::new(comm, device);
    let sizes = (0..grads.len())
        .filter(|&i| present[i])
        .map(|i| params[i].elem_count());
    bucket.reserve(bucket_values(sizes));
    for root in roots {
        for i in 0..grads.len() {
            if !present[i] || root.is_some_and(|r| owner.is_some_and(|o| o[i] != r)) {
                continue;
            }
            let n = params[i].elem_count();
            if bucket.len > 0 && bucket.len + n > BUCKET {
                bucket.flush(root, params, &mut out)?;
            }
            let g = grads[i].take();
            if let Some(g) = &g {
                if g.elem_count() != n {
                    return Err(Error::Invalid(format!(
                        "parameter {i}: a gradient of {} values for {n}",
                        g.elem_count()
                    )));
                }
            }
            bucket.push(i, g, n)?;
        }
        bucket.flush(root, params, &mut out)?;
    }
    Ok((out, present))
}

/// The values of the parameters `members`, one after the other, on their way to a collective:
/// in host memory (`values`), or as tensors on the GPU (`parts`) when the ranks' GPUs sum them.
struct Bucket<'a> {
    comm: &'a Comm,
    device: &'a Device,
    /// Summed on the GPU under NCCL rather than through host memory.
    on_gpu: bool,
    values: Vec<f32>,
    parts: Vec<Tensor>,
    members: Vec<usize>,
    /// How many values the bucket holds.
    len: usize,
}

impl<'a> Bucket<'a> {
    /// An empty bucket: summed on the GPU when `device` is one and its ranks joined NCCL.
    fn new(comm: &'a Comm, device: &'a Device) -> Self {
        #[cfg(feature = "nccl")]
        let on_gpu = device.is_cuda() && comm.gpus().is_some();
        #[cfg(not(feature = "nccl"))]
        let on_gpu = false;
        Bucket {
            comm,
            device,
            on_gpu,
            values: Vec::new(),
            parts: Vec::new(),
            members: Vec::new(),
            len: 0,
        }
    }

    /// Room for `values` values in host memory at once (none on the GPU), made once: the
    /// bucket then never grows by doubling past what it holds.
    fn reserve(&mut self, values: usize) {
        if !self.on_gpu {
            self.values.reserve_exact(values);
        }
    }

    /// Adds parameter `i`'s gradient `g` of `n` values (zeros where this rank has none).
    fn push(&mut self, i: usize, g: Option<Tensor>, n: usize) -> Result<()> {
        if self.on_gpu {
            self.parts.push(match g {
                Some(g) => g.to_dtype(DType::F32)?.flatten_all()?,
                None => Tensor::zeros(n, DType::F32, self.device)?,
            });
        } else {
            match g {
                Some(g) => {
                    let g = g.to_dtype(DType::F32)?.flatten_all()?;
                    // An fp32 host gradient is read in place, not copied out first.
                    let values = &mut self.values;
                    let read = ft_kernels::host::with_f32(&g, |s| values.extend_from_slice(s));
                    if read.is_none() {
                        self.values.extend(g.to_vec1::<f32>()?);
                    }
                }
                None => self.values.resize(self.values.len() + n, 0.0),
            }
        }
        self.members.push(i);
        self.len += n;
        Ok(())
    }

    /// Sums the values over the ranks (into `root` alone, when given) and, where the sum
    /// arrived, puts each member's part back as its parameter's gradient.
    fn flush(
        &mut self,
        root: Option<usize>,
        params: &[Var],
        out: &mut [Option<Tensor>],
    ) -> Result<()> {
        if self.members.is_empty() {
            return Ok(());
        }
        let arrives = root.is_none_or(|r| r == self.comm.rank());
        if self.on_gpu {
            let sum = self.sum_on_gpu(root)?;
            let mut at = 0;
            for &i in self.members.iter().take_while(|_| arrives) {
                let n = params[i].elem_count();
                // Views of the one summed buffer, freed with the last of them.
                out[i] = Some(sum.narrow(0, at, n)?.reshape(params[i].shape())?);
                at += n;
            }
        } else {
            match root {
                None => self.comm.all_reduce_sum(&mut self.values)?,
                Some(r) => self.comm.reduce_sum(&mut self.values, r)?,
            }
            let mut at = 0;
            for &i in self.members.iter().take_while(|_| arrives) {
                let n = params[i].elem_count();
                let part = self.values.get(at..at + n).ok_or_else(|| {
                    Error::Invalid(format!("parameter {i}: the reduced bucket is short"))
                })?;
                out[i] = Some(Tensor::from_slice(part, params[i].shape(), self.device)?);
                at += n;
            }
        }
        self.values.clear();
        self.parts.clear();
        self.members.clear();
        self.len = 0;
        Ok(())
    }

    #[cfg(feature = "nccl")]
    fn sum_on_gpu(&self, root: Option<usize>) -> Result<Tensor> {
        let gpus = self
            .comm
            .gpus()
            .ok_or_else(|| Error::Invalid("a GPU bucket without NCCL".into()))?;
        super::reduce_gpu::sum_parts(gpus, &self.parts, root)
    }

    #[cfg(not(feature = "nccl"))]
    fn sum_on_gpu(&self, _: Option<usize>) -> Result<Tensor> {
        Err(Error::Invalid(
            "a GPU bucket in a build without the `nccl` feature".into(),
        ))
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

/// The GPU bucket on one GPU, NCCL's world of one (the sum is then each rank's own): the
/// buckets' concatenation, the in-place sum and the split back to each parameter's shape, on
/// every rank and to an owner. Skips without a GPU (fails with `FT_REQUIRE_GPU=1`).
#[cfg(all(test, feature = "nccl"))]
mod gpu_tests {
    use super::*;

    #[test]
    fn a_gpu_bucket_sums_in_place_and_splits_back() -> Result<()> {
        let Some((device, comm)) = super::super::reduce_gpu::joined_gpu()? else {
            return Ok(());
        };
        let params = [
            Var::zeros((2, 3), DType::BF16, &device)?,
            Var::zeros(4, DType::F32, &device)?,
            Var::zeros(2, DType::F32, &device)?,
        ];
        let g0 = Tensor::arange(0f32, 6.0, &device)?
            .reshape((2, 3))?
            .to_dtype(DType::BF16)?;
        let g2 = Tensor::new(&[-1.5f32, 2.5], &device)?;
        let host = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        };
        for owner in [None, Some(&[0usize, 0, 0][..])] {
            let grads = vec![Some(g0.clone()), None, Some(g2.clone())];
            let (out, present) =
                sum_gradients(&comm, grads, &params, &device, owner, &mut [], &mut none)?;
            assert_eq!(present, [true, false, true]);
            let s0 = out[0].as_ref().ok_or(Error::Invalid("no sum 0".into()))?;
            assert_eq!((s0.dims(), s0.dtype()), (&[2usize, 3][..], DType::F32));
            assert_eq!(host(s0)?, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
            assert!(out[1].is_none());
            let s2 = out[2].as_ref().ok_or(Error::Invalid("no sum 2".into()))?;
            assert_eq!(host(s2)?, [-1.5, 2.5]);
        }
        Ok(())
    }
}
