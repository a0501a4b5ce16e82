//! The rounds in which the ranks of a data-parallel run meet inside their backward passes: each
//! rank offers the gradients its backward has just finished (a checkpoint segment's, as that
//! segment's backward ends; after the backward, the rest), and every rank's offers of the round
//! are summed over the ranks in one collective ([`super::reduce`]'s buckets). A rank whose
//! backward has ended (or that has no micro-batch) keeps answering, offering nothing, until
//! every rank's has: the rounds line up because every rank's backward finishes the same
//! segments in the same order (the ranks agreed on the model and the configuration).
//!
//! Used by the fused backward ([`super::MixedOptimizer::backward_and_step_across`], each sum
//! updated as it arrives) and by the plain one ([`super::MixedOptimizer::backward_and_reduce_across`],
//! the sums kept for the step's update).

use std::rc::Rc;
use std::sync::Mutex;

use candle_core::{Device, Tensor, Var};
use ft_dist::Comm;

use super::reduce::{sum_round, Round};
use super::GradAccumulator;
use crate::error::{Error, Result};

/// How a backward pass meets the other ranks of a data-parallel run.
#[derive(Clone)]
pub struct BackwardRanks {
    /// The run's communicator, asked for on the thread that runs the backward (the backward's
    /// hook must be `Send` and `Sync`, while MPI's handles stay on the thread that made them):
    /// the thread that made it, since candle's backward runs the hook on its calling thread.
    pub comm: fn() -> Result<Rc<Comm>>,
    /// Where the sums over the ranks are put (the gradient accumulator's device).
    pub device: Device,
    /// The loop's step (from 1), where `FT_FAULT` may fail a round.
    pub step: u64,
}

/// The rounds of one backward pass across ranks.
pub(super) struct Rounds {
    pub(super) ranks: BackwardRanks,
    /// The model's parameters (their shapes, for the sums).
    params: Vec<Var>,
    /// Under ZeRO, each parameter's owner: the rank its sums reach.
    owner: Option<Vec<usize>>,
    /// Parameters summed in this backward's rounds so far.
    summed: Mutex<Vec<bool>>,
}

impl Rounds {
    pub(super) fn new(ranks: BackwardRanks, params: Vec<Var>, owner: Option<Vec<usize>>) -> Self {
        let n = params.len();
        Rounds {
            ranks,
            params,
            owner,
            summed: Mutex::new(vec![false; n]),
        }
    }

    /// One round: `offered` (this rank's, maybe none) summed over the ranks with theirs, the
    /// sums reaching this rank (every sum, or under ZeRO its own parameters'), whether every
    /// rank's backward has ended (`finished`: this one's has) and whether some rank failed
    /// (`failed`: this one has). A parameter summed in two rounds means the ranks' backwards
    /// finished it at different points (they hold different models or segments): an error.
    ///
    /// `earlier`, this rank's sums of the step's earlier micro-batches where the sums over the
    /// ranks hold them (not where their owners already do): a parameter another rank offers in
    /// this round and this one does not (its last micro-batch gave no gradient of it, its
    /// earlier ones did) goes in with its sum taken from `earlier`, in the same round.
    pub(super) fn round(
        &self,
        offered: Vec<(usize, Tensor)>,
        finished: bool,
        failed: bool,
        earlier: Option<&Mutex<GradAccumulator>>,
    ) -> Result<Round> {
        let comm = (self.ranks.comm)()?;
        let mut fill = |i: usize| earlier.and_then(|e| locked(e).take_one(i));
        let round = sum_round(
            &comm,
            offered,
            finished,
            failed,
            &self.params,
            &self.ranks.device,
            self.owner.as_deref(),
            &mut fill,
        )?;
        let mut summed = locked(&self.summed);
        let now = round.summed.iter().enumerate().filter(|(_, s)| **s);
        for (i, _) in now {
            if std::mem::replace(&mut summed[i], true) {
                return Err(Error::Invalid(format!(
                    "rank {}: parameter {i} of shape {:?} was summed in two rounds of a \
                     backward: the ranks finished its gradient at different points of their \
                     backward (different models or checkpointing; --checkpointing none sums \
                     after the backward)",
                    comm.rank(),
                    self.params[i].dims()
                )));
            }
        }
        Ok(round)
    }

    /// Which parameters some rank offered in this backward's rounds.
    pub(super) fn summed(&self) -> Vec<bool> {
        locked(&self.summed).clone()
    }
}

pub(super) fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
