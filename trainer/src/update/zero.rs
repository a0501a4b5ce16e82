//! ZeRO stages 1 and 2 (DeepSpeed's Zero Redundancy Optimizer) over a data-parallel run's
//! ranks: each parameter has one owner rank, which alone keeps its optimizer state and steps it.
//!
//! - Stage 1: each rank sums its micro-batches' gradients whole, as without ZeRO; in the step's
//!   last backward each parameter's sum over the ranks reaches its owner alone, a checkpoint
//!   segment at a time ([`super::reduce_backward`]); each rank updates the parameters it owns,
//!   with the state of those alone.
//! - Stage 2: the same reduce to the owners runs in every micro-batch's backward: a rank's
//!   gradient accumulator holds the fp32 sums of its own parameters alone, a world-th of the
//!   model's, and one segment's gradients at a time. (Under the fused backward the step's last
//!   micro-batch's segments' sums reach their owners in its rounds, and each owner adds its
//!   sums of the earlier ones as they arrive.) (A rank with fewer micro-batches in the step
//!   answers the others' rounds, so every rank joins every reduce.)
//!
//! The fp32 master weights are partitioned like the state (as DeepSpeed's are): a rank keeps the
//! masters of its own parameters. After the update each owner sends its model's weights as
//! updated (written from its masters where there are some), in the model's dtype, and the
//! others write those bits into their model: every rank then holds the weights one process
//! would ([`Zero::share_updates`]). (A
//! task that reads the fp32 weights after each step reads its share: sdxl-ft's EMA is kept by
//! the same owners.) Parameters are assigned
//! greedily by size, largest first, each to the rank with the fewest values so far (PyTorch's
//! ZeroRedundancyOptimizer), the same on every rank.
//!
//! The clipping norm is exact: each rank's per-tensor sums of squares of the gradients it owns
//! travel in one all-reduce (every entry summed with zeros), then are added in parameter order
//! as one process adds them. A checkpoint's state goes to rank 0 one tensor at a time
//! ([`super::gather`]), which saves it whole: it resumes at any number of ranks, with or
//! without ZeRO.

use std::rc::Rc;

use candle_core::{Device, Tensor, Var};
use ft_dist::Comm;

use super::gather::{append_bytes, byte_len, from_bytes};
use super::norm::sum_of_squares_each;
use super::reduce::{all_reduce_gradients, reduce_gradients_to_owners, BUCKET};
use crate::error::{Error, Result};

/// The ZeRO stage of a run and each parameter's owner.
pub struct Zero {
    stage: u8,
    /// Each parameter's number of values.
    sizes: Vec<usize>,
    comm: Rc<Comm>,
    owner: Vec<usize>,
    /// The parameters that had a gradient on some rank at the last reduce: what the owners
    /// update and then send.
    present: Vec<bool>,
    /// Stage 2: the parameters that had a gradient on some rank in this step's micro-batches
    /// reduced so far (`None` until the first): the sums are then on their owners already.
    reduced: Option<Vec<bool>>,
}

/// The most values [`partition`] gives one rank: what the rank holding the most keeps of a
/// state of one value a parameter value.
pub fn largest_share(sizes: &[usize], world: usize) -> usize {
    let owner = partition(sizes, world);
    (0..world.max(1))
        .map(|r| {
            (0..sizes.len())
                .filter(|&i| owner[i] == r)
                .map(|i| sizes[i])
                .sum()
        })
        .max()
        .unwrap_or(0)
}

/// Each of the parameters of `sizes` values assigned to one of `world` ranks: largest first, to
/// the rank holding the fewest values so far (the lowest such rank on a tie).
pub fn partition(sizes: &[usize], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
    let mut load = vec![0usize; world];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let (r, _) = load
            .iter()
            .enumerate()
            .min_by_key(|&(r, l)| (*l, r))
            .unwrap_or((0, &0));
        owner[i] = r;
        load[r] += sizes[i];
    }
    owner
}

impl Zero {
    /// ZeRO `stage` (1 or 2) over the ranks of `comm`, for parameters of `sizes` values.
    pub fn new(stage: u8, comm: Rc<Comm>, sizes: &[usize]) -> Result<Self> {
        if !(1..=2).contains(&stage) {
            return Err(Error::Invalid(format!(
                "--zero {stage}: stages 1 (optimizer state) and 2 (and gradients) are \
                 supported, 0 is off"
            )));
        }
        let owner = partition(sizes, comm.world());
        Ok(Zero {
            stage,
            sizes: sizes.to_vec(),
            comm,
            present: vec![false; owner.len()],
            reduced: None,
            owner,
        })
    }

    pub fn stage(&self) -> u8 {
        self.stage
    }

    /// The ranks' communicator.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// Each parameter's owner rank.
    pub fn owners(&self) -> &[usize] {
        &self.owner
    }

    /// Which parameters had a gradient on some rank this step, as a fused backward's rounds
    /// summed them: what the owners updated and [`Zero::share_updates`] then sends.
    pub fn set_present(&mut self, present: Vec<bool>) {
        self.present = present;
    }

    /// Whether this rank owns parameter `i`.
    pub fn owns(&self, i: usize) -> bool {
        self.owner.get(i) == Some(&self.comm.rank())
    }

    /// Whether each micro-batch's gradients go to their owners as its backward ends (stage 2
    /// with several ranks), so that the accumulator holds this rank's sums alone.
    pub fn reduces_each_micro_batch(&self) -> bool {
        self.stage == 2 && self.comm.world() > 1
    }

    /// Forgets the micro-batches reduced so far (a step that starts again after an
    /// out-of-memory split, or a skipped one).
    pub fn discard_reduced(&mut self) {
        self.reduced = None;
    }

    /// Records that a backward summed the parameters `present` onto their owners (some rank
    /// had their gradient): under stage 2 each micro-batch's, under stage 1 the step's. The
    /// owners' accumulators hold those sums, and [`Zero::reduce`] passes them on.
    pub fn note_reduced(&mut self, present: Vec<bool>) {
        let seen = self
            .reduced
            .get_or_insert_with(|| vec![false; present.len()]);
        for (s, p) in seen.iter_mut().zip(present) {
            *s |= p;
        }
    }

    /// The step's gradients summed over the ranks, kept for the parameters this rank owns
    /// (`None` for the others). After a backward that summed them ([`Zero::note_reduced`]),
    /// `grads` are those sums already (this rank's accumulator), and nothing travels.
    pub fn reduce(
        &mut self,
        grads: Vec<Option<Tensor>>,
        params: &[Var],
        device: &Device,
    ) -> Result<Vec<Option<Tensor>>> {
        if let Some(present) = self.reduced.take() {
            self.present = present;
            let mut grads = grads;
            grads.resize(params.len(), None);
            return Ok(grads);
        }
        let (mut out, present) = if self.stage == 1 {
            let out = all_reduce_gradients(&self.comm, grads, params, device)?;
            let present = out.iter().map(Option::is_some).collect();
            (out, present)
        } else {
            reduce_gradients_to_owners(&self.comm, grads, params, device, &self.owner)?
        };
        self.present = present;
        for (i, g) in out.iter_mut().enumerate() {
            if !self.owns(i) {
                *g = None;
            }
        }
        Ok(out)
    }

    /// The sum of squares of the whole step's gradients from this rank's share of them
    /// (`grads`, `None` where another rank owns the parameter): the same number, bit for bit,
    /// as one process's [`super::sum_of_squares`] on the CPU.
    pub fn sum_of_squares(&self, grads: &[Option<Tensor>]) -> Result<f64> {
        let mine: Vec<(usize, Tensor)> = grads
            .iter()
            .enumerate()
            .filter_map(|(i, g)| g.clone().map(|g| (i, g)))
            .collect();
        let tensors: Vec<Tensor> = mine.iter().map(|(_, g)| g.clone()).collect();
        let mut each = vec![0f64; grads.len()];
        for ((i, _), s) in mine.iter().zip(sum_of_squares_each(&tensors)?) {
            each[*i] = s;
        }
        self.comm.all_reduce_sum(&mut each)?;
        Ok(each
            .iter()
            .zip(&self.present)
            .filter(|(_, p)| **p)
            .fold(0f64, |sq, (s, _)| sq + s))
    }

    /// After the owners' update (which wrote their masters, where there are some, into their
    /// model): each owner sends the model weights it updated, in the model's dtype, and the
    /// other ranks write them into theirs, so that every rank holds the weights one process
    /// would (each keeps the masters of its own parameters alone). bf16 or f16 weights travel
    /// in half the bytes of their fp32 masters, and a receiver rounds nothing: it takes the
    /// owner's bits. On GPUs whose ranks joined NCCL the weights go from GPU to GPU, into the
    /// receivers' weights in place; elsewhere through host memory, in buckets of at most
    /// [`BUCKET`] fp32 values' bytes.
    pub fn share_updates(&self, model: &[Var]) -> Result<()> {
        #[cfg(feature = "nccl")]
        if let Some(nccl) = self.comm.gpus() {
            if model.iter().all(|w| w.device().is_cuda()) {
                for (i, w) in model.iter().enumerate() {
                    if self.present[i] {
                        super::reduce_gpu::broadcast_weight(nccl, w.as_tensor(), self.owner[i])?;
                    }
                }
                return Ok(());
            }
        }
        let me = self.comm.rank();
        let bytes = |i: usize| byte_len(model[i].as_tensor());
        for root in 0..self.comm.world() {
            let members: Vec<usize> = (0..self.sizes.len())
                .filter(|&i| self.present[i] && self.owner[i] == root)
                .collect();
            for chunk in buckets(&members, bytes, BUCKET * 4) {
                if me == root {
                    self.comm.broadcast(&mut message(model, &chunk)?, root)?;
                    continue;
                }
                let mut buf = vec![0u8; chunk.iter().map(|&i| bytes(i)).sum()];
                self.comm.broadcast(&mut buf, root)?;
                write_message(model, &chunk, &buf)?;
            }
        }
        Ok(())
    }

    /// What this rank restores of a whole checkpoint's state: the per-parameter state
    /// (`{kind}.{i}`, masters too) of the parameters it owns, and what belongs to no parameter.
    pub fn own_state(&self, tensors: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        tensors
            .iter()
            .filter(|(name, _)| {
                let index = name
                    .rsplit_once('.')
                    .and_then(|(_, i)| i.parse::<usize>().ok());
                match index {
                    None => true,
                    Some(i) => self.owns(i),
                }
            })
            .cloned()
            .collect()
    }
}

/// What an owner sends of the weights `chunk` of `model`: their values one after another, each
/// in its own dtype's bytes.
fn message(model: &[Var], chunk: &[usize]) -> Result<Vec<u8>> {
    // Its whole length at once: grown by doubling, the buffer would reach up to twice that,
    // with the old one beside it while it moves.
    let len = chunk.iter().map(|&i| byte_len(model[i].as_tensor())).sum();
    let mut buf = Vec::with_capacity(len);
    for &i in chunk {
        append_bytes(model[i].as_tensor(), &mut buf)?;
    }
    Ok(buf)
}

/// A [`message`] of the weights `chunk`, written into this rank's `model`.
fn write_message(model: &[Var], chunk: &[usize], buf: &[u8]) -> Result<()> {
    let mut at = 0;
    for &i in chunk {
        let w = &model[i];
        let n = byte_len(w.as_tensor());
        let values = buf
            .get(at..at + n)
            .ok_or_else(|| Error::Invalid(format!("weight {i}: the owner's message is short")))?;
        w.set(&from_bytes(values, w.dtype(), w.dims(), w.device())?)?;
        at += n;
    }
    Ok(())
}

/// `members` in consecutive groups of at most `limit` in all by `size` (one larger member
/// alone).
fn buckets(members: &[usize], size: impl Fn(usize) -> usize, limit: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut filled = 0;
    for &i in members {
        match out.last_mut() {
            Some(last) if filled + size(i) <= limit => last.push(i),
            _ => {
                out.push(vec![i]);
                filled = 0;
            }
        }
        filled += size(i);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partition_balances_values_largest_first() {
        // 10 and 1 to rank 0, 8 and 2 to rank 1, 6 and 4 to rank 2 (loads 11, 10, 10).
        let owner = partition(&[4, 10, 1, 8, 6, 2], 3);
        assert_eq!(owner, [2, 0, 0, 1, 2, 1]);
        assert_eq!(partition(&[3, 3, 3], 1), [0, 0, 0]);
        // Ties go to the lowest rank, in parameter order.
        assert_eq!(partition(&[5, 5, 5, 5], 2), [0, 1, 0, 1]);
    }

    #[test]
    fn buckets_hold_at_most_a_bucket_unless_one_member_is_larger() {
        let sizes = [BUCKET / 2, BUCKET / 2, 1, BUCKET * 2, 3];
        let b = buckets(&[0, 1, 2, 3, 4], |i| sizes[i], BUCKET);
        assert_eq!(b, vec![vec![0, 1], vec![2], vec![3], vec![4]]);
    }

    /// The owner's message holds the weights as the model does (a bf16 weight in 2 bytes a
    /// value, not its fp32 master's 4), and a receiver's model gets the owner's bits.
    #[test]
    fn an_owners_message_is_its_model_in_its_dtype() -> Result<()> {
        use candle_core::DType;
        let x = Tensor::new(&[1.5f32, -3.25e-5, 7e30, -0.0, 0.1], &Device::Cpu)?;
        let owner = [
            Var::from_tensor(&x.to_dtype(DType::BF16)?)?,
            Var::from_tensor(&x.reshape((5, 1))?)?,
            Var::from_tensor(&x.to_dtype(DType::F16)?)?,
        ];
        let buf = message(&owner, &[0, 2, 1])?;
        assert_eq!(buf.len(), 5 * 2 + 5 * 2 + 5 * 4);
        // Made at its length: grown by doubling it would take up to twice that (here 60).
        let in_order = message(&owner, &[0, 1, 2])?;
        assert_eq!(in_order.capacity(), in_order.len());
        let receiver = [
            Var::zeros(5, DType::BF16, &Device::Cpu)?,
            Var::zeros((5, 1), DType::F32, &Device::Cpu)?,
            Var::zeros(5, DType::F16, &Device::Cpu)?,
        ];
        write_message(&receiver, &[0, 2, 1], &buf)?;
        for (o, r) in owner.iter().zip(&receiver) {
            assert_eq!(
                message(std::slice::from_ref(r), &[0])?,
                message(std::slice::from_ref(o), &[0])?
            );
        }
        assert!(write_message(&receiver, &[0, 2, 1], &buf[1..]).is_err());
        Ok(())
    }

    #[test]
    fn one_rank_owns_everything_and_keeps_its_state() -> Result<()> {
        let z = Zero::new(2, Rc::new(Comm::solo()), &[2, 3])?;
        assert!(z.owns(0) && z.owns(1) && !z.owns(2));
        let t = Tensor::new(&[1f32], &Device::Cpu)?;
        let state = vec![
            ("exp_avg.1".to_string(), t.clone()),
            ("master.0".to_string(), t.clone()),
            ("master.2".to_string(), t.clone()),
        ];
        assert_eq!(z.own_state(&state).len(), 2);
        assert!(Zero::new(3, Rc::new(Comm::solo()), &[1]).is_err());
        Ok(())
    }

    #[test]
    fn the_largest_share_is_the_most_loaded_rank() {
        // Loads 11, 10, 10 (the partition test above).
        assert_eq!(largest_share(&[4, 10, 1, 8, 6, 2], 3), 11);
        assert_eq!(largest_share(&[4, 10, 1], 1), 15);
    }
}

/// The owners' weights over NCCL on one GPU, a world of one (the owner is every weight's
/// receiver too, so the broadcast must leave each as it is): every dtype of a model's weights,
/// and a tensor whose values start inside its buffer. In a world of one it checks the dtype
/// dispatch, the layouts taken and the errors, not where the values land: that needs two GPUs.
/// Skips without a GPU (fails with `FT_REQUIRE_GPU=1`).
#[cfg(all(test, feature = "nccl"))]
mod gpu_tests {
    use candle_core::DType;

    use super::*;

    fn values(t: &Tensor) -> Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }

    #[test]
    fn weights_on_a_gpu_go_by_nccl_in_their_own_dtype() -> Result<()> {
        let Some((device, comm)) = super::super::reduce_gpu::joined_gpu()? else {
            return Ok(());
        };
        let comm = Rc::new(comm);
        let x = Tensor::arange(0f32, 12.0, &device)?.affine(0.37, -1.0)?;
        let model = [
            Var::from_tensor(&x.to_dtype(DType::BF16)?)?,
            Var::from_tensor(&x.to_dtype(DType::F16)?.reshape((2, 6))?)?,
            Var::from_tensor(&x)?,
        ];
        let kept: Vec<Vec<f32>> = model.iter().map(|v| values(v)).collect::<Result<_>>()?;
        let sizes: Vec<usize> = model.iter().map(|v| v.elem_count()).collect();
        let mut z = Zero::new(1, comm.clone(), &sizes)?;
        z.set_present(vec![true; model.len()]);
        z.share_updates(&model)?;
        for (v, k) in model.iter().zip(&kept) {
            assert_eq!(&values(v)?, k, "{:?}", v.dtype());
        }
        let gpus = comm
            .gpus()
            .ok_or(Error::Invalid("no NCCL after the join".into()))?;
        let wide = x.reshape((3, 4))?.copy()?;
        let row = wide.narrow(0, 1, 1)?;
        super::super::reduce_gpu::broadcast_weight(gpus, &row, 0)?;
        assert_eq!(values(&wide)?, values(&x)?);
        let host = Tensor::new(&[1f32], &Device::Cpu)?;
        assert!(super::super::reduce_gpu::broadcast_weight(gpus, &host, 0).is_err());
        Ok(())
    }
}
