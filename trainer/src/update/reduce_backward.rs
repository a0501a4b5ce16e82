//! A data-parallel step's gradients summed over the ranks inside the backward, a checkpoint
//! segment at a time as each segment's backward ends (PyTorch DDP's buckets, DeepSpeed
//! ZeRO-2's reduce during backward), the sums kept for the step's update (clipped by the global
//! norm, as one process clips): the plain backward's counterpart of the fused one's rounds.
//!
//! What a rank holds then: without ZeRO, each segment's gradients until its round (not the
//! whole model's beside the sums that replace them); under ZeRO, the sums of its own parameters
//! and one segment's gradients, never a micro-batch's whole. On GPUs under NCCL, each segment's
//! sum is queued on the stream behind that segment's backward.
//!
//! A rank whose backward fails with out of memory (or whose sums fail to allocate between two
//! rounds) tells the others in the next round; every rank then stops its backward, answers the
//! rounds until each one's has ended, and drops the step's sums: the step runs again split on
//! every rank, as it would had the error come before the rounds (nothing has reached the
//! weights). An error inside a round's collective, or after the last round, leaves the ranks
//! out of step and ends the run (never as an out-of-memory error, which the step would retry
//! while others wait), as does any other error.

use std::sync::{Arc, Mutex};

use candle_core::Tensor;
use ft_params::checkpoint::Checkpointer;

use super::rounds::{locked, BackwardRanks, Rounds};
use super::{GradAccumulator, MixedOptimizer};
use crate::error::{Error, Result};

impl MixedOptimizer {
    /// One micro-batch's backward (`loss`, dropped with its graph when the backward ends;
    /// None for a rank without one this round, which answers the others' rounds) with its gradients summed over the ranks as each segment's
    /// backward ends, the sums put into `sums`:
    ///
    /// - Under ZeRO-2 ([`Self::reduces_each_micro_batch`]) every micro-batch's backward runs
    ///   so: its gradients reach their owners, and `sums` (this rank's accumulator) adds the
    ///   sums of its own parameters alone.
    /// - Otherwise the step's last micro-batch's: each offered gradient is this rank's whole
    ///   sum over the step (`sums`' earlier micro-batches added first), and `sums` comes back
    ///   holding the sums over the ranks (under ZeRO-1, of this rank's parameters).
    ///
    /// Then [`Self::reduce_gradients`] hands the sums to the update as they are. Every rank
    /// calls this at the same point of the step. Returns the gradients summed during the
    /// backward (the rest after it).
    pub fn backward_and_reduce_across(
        &mut self,
        checkpointer: &Checkpointer,
        loss: Option<Tensor>,
        sums: &mut GradAccumulator,
        ranks: &BackwardRanks,
    ) -> Result<usize> {
        let n = self.model.len();
        let owner = self.zero.as_ref().map(|z| z.owners().to_vec());
        // Under ZeRO-2 the sums over the ranks add into this rank's accumulator as they arrive;
        // otherwise its sums are what it offers, and the sums over the ranks fill an empty one.
        let earlier = if self.reduces_each_micro_batch() {
            GradAccumulator::new()
        } else {
            sums.take_whole()
        };
        let mut into = sums.take_whole();
        into.reserve(n)?;
        let offers = Arc::new(Offers {
            rounds: Rounds::new(ranks.clone(), self.model.clone(), owner),
            earlier: Mutex::new(earlier),
            into: Mutex::new(into),
            failure: Mutex::new(None),
        });
        let backward = match loss {
            Some(loss) => {
                let hook = {
                    let offers = offers.clone();
                    self.early_hook(move |mine| offers.offer(mine))
                };
                let grads = checkpointer.gradients_with(&loss, &self.model, Some(hook));
                // The graph goes before the last rounds (without segments, all of it).
                drop(loss);
                grads.map_err(Error::from)
            }
            None => Ok((vec![None; n], 0)),
        };
        // After the backward (ended, failed, or stopped for another rank's failure): the
        // rounds answered until every rank's backward has ended.
        let taken = offers.finish(backward);
        *sums = locked(&offers.into).take_whole();
        if let Err(e) = taken {
            sums.take();
            self.discard_reduced();
            return Err(e);
        }
        self.note_reduced(offers.rounds.summed());
        sums.end_micro_batch();
        taken
    }
}

/// What went wrong in a backward across ranks.
enum Failure {
    /// This rank ran out of memory (told to the others in the rounds).
    Mine(Error),
    /// Another rank's backward failed (seen in a round).
    Others,
    /// A round itself failed: the ranks no longer line up, the run ends.
    Fatal(Error),
}

/// The state a backward across ranks shares with its hook.
struct Offers {
    rounds: Rounds,
    /// Without ZeRO-2: this rank's sums of the step's earlier micro-batches, added to what it
    /// offers.
    earlier: Mutex<GradAccumulator>,
    /// Where the sums over the ranks that reach this rank are added as they arrive.
    into: Mutex<GradAccumulator>,
    failure: Mutex<Option<Failure>>,
}

impl Offers {
    /// A segment's gradients, as its backward ends: summed over the ranks in one round. An
    /// error stops this rank's backward (another rank failed, or this round did).
    fn offer(&self, grads: Vec<(usize, Tensor)>) -> Result<()> {
        if locked(&self.failure).is_some() {
            return Err(stopped());
        }
        let step = self.rounds.ranks.step;
        let rank = (self.rounds.ranks.comm)()?.rank();
        if crate::fault::fires("reduce-round", rank, step)? {
            *locked(&self.failure) = Some(Failure::Mine(Error::OutOfMemory {
                phase: "backward".into(),
                step,
                detail: format!(
                    "rank {rank}: a failure made on purpose between two segments' sums \
                     (FT_FAULT)"
                ),
            }));
            return Err(stopped());
        }
        let offered = match locked(&self.earlier).take_with_each(grads) {
            Ok(offered) => offered,
            // Before this rank's round: the others can still be told.
            Err(e) => return Err(self.fail(e)),
        };
        let round = match self
            .rounds
            .round(offered, false, false, Some(&self.earlier))
        {
            Ok(round) => round,
            Err(e) => {
                let text = e.to_string();
                *locked(&self.failure) = Some(Failure::Fatal(e));
                return Err(Error::Invalid(text));
            }
        };
        if let Err(e) = self.keep(round.sums) {
            return Err(self.fail(e));
        }
        if round.failed {
            *locked(&self.failure) = Some(Failure::Others);
            return Err(stopped());
        }
        Ok(())
    }

    /// This rank's error `e` between rounds: out of memory is told to the others in the next
    /// round (the step then splits on every rank); anything else ends the run. The error that
    /// stops the backward.
    fn fail(&self, e: Error) -> Error {
        let failure = if e.is_out_of_memory() {
            Failure::Mine(e)
        } else {
            Failure::Fatal(e)
        };
        *locked(&self.failure) = Some(failure);
        stopped()
    }

    /// After the backward: its last gradients (and the earlier micro-batches' sums of the
    /// parameters it gave none) offered, then the rounds answered until every rank's backward
    /// has ended. The gradients summed during the backward, or why the step cannot stand.
    fn finish(&self, backward: Result<(Vec<Option<Tensor>>, usize)>) -> Result<usize> {
        let failure = locked(&self.failure).take();
        let (mut offered, taken, mut failure) = match (backward, failure) {
            (_, Some(Failure::Fatal(e))) => return Err(ends_the_run(e)),
            (Ok((grads, taken)), None) => {
                let rest: Vec<(usize, Tensor)> = grads
                    .into_iter()
                    .enumerate()
                    .filter_map(|(i, g)| Some((i, g?)))
                    .collect();
                let mut earlier = locked(&self.earlier);
                match earlier.take_with_each(rest) {
                    Ok(mut offered) => {
                        offered.extend(earlier.take_remaining());
                        (offered, taken, None)
                    }
                    Err(e) if e.is_out_of_memory() => (Vec::new(), 0, Some(Failure::Mine(e))),
                    Err(e) => return Err(ends_the_run(e)),
                }
            }
            // This rank's own allocation failure: told to the others, the step split.
            (Err(e), None) if e.is_out_of_memory() => (Vec::new(), 0, Some(Failure::Mine(e))),
            (Err(e), None) => return Err(e),
            (_, Some(f)) => (Vec::new(), 0, Some(f)),
        };
        locked(&self.earlier).take();
        loop {
            let mine = matches!(failure, Some(Failure::Mine(_)));
            // A failed collective leaves the ranks out of step: whatever it says, the run ends.
            let round = self
                .rounds
                .round(std::mem::take(&mut offered), true, mine, None)
                .map_err(ends_the_run)?;
            if let Err(e) = self.keep(round.sums) {
                // The last round (the others have left theirs) or not an allocation failure:
                // the ranks cannot agree on a retry.
                if round.all_finished || !e.is_out_of_memory() {
                    return Err(ends_the_run(e));
                }
                // Told in the next round (every rank answers until all have ended).
                failure.get_or_insert(Failure::Mine(e));
                continue;
            }
            if round.failed && failure.is_none() {
                failure = Some(Failure::Others);
            }
            if round.all_finished {
                break;
            }
        }
        match failure {
            None => Ok(taken),
            Some(Failure::Mine(e)) => Err(e),
            Some(Failure::Fatal(e)) => Err(ends_the_run(e)),
            Some(Failure::Others) => Err(Error::OutOfMemory {
                phase: "backward".into(),
                step: self.rounds.ranks.step,
                detail: "another rank ran out of memory in its backward".into(),
            }),
        }
    }

    /// A round's sums into this rank's accumulator.
    fn keep(&self, sums: Vec<(usize, Tensor)>) -> Result<()> {
        let mut into = locked(&self.into);
        sums.into_iter().try_for_each(|(i, s)| into.add_one(i, s))
    }
}

/// An error after which the ranks' rounds no longer line up: never out of memory (which the
/// step would retry while other ranks wait in a collective), so that `ranks::main` ends every
/// rank.
fn ends_the_run(e: Error) -> Error {
    if e.is_out_of_memory() {
        return Error::Invalid(format!(
            "{e} (inside the ranks' gradient sums, where the step cannot run again: the run \
             ends; resume from the last checkpoint with a smaller --batch-size)"
        ));
    }
    e
}

/// The error that stops a rank's backward from inside its hook (the reason is kept aside).
fn stopped() -> Error {
    Error::Invalid("the backward stopped: the ranks' rounds failed".into())
}
