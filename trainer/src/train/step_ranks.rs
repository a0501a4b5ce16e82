//! The step's paths that exist only with several ranks ([`super::step`] is the loop's step):
//! the ranks agree after a forward that none ran out of memory and none met a non-finite loss,
//! then their backward sums each segment's gradients over the ranks in rounds as it ends: the
//! fused backward updates from them, the plain one keeps them for the step's update (the
//! step's last micro-batch; under ZeRO-2 every micro-batch, each reduced onto its owners). Also
//! the error a rank reports when others ran out of memory, and the agreement that all split the
//! next steps when one's fused backward passed the `--fit` budget.

use candle_core::Tensor;

use super::step::{Local, Loop, Piece};
use super::task::Task;
use crate::error::{Error, Result};
use crate::update::{BackwardRanks, LossNorm};

impl<T: Task> Loop<'_, T> {
    /// [`Self::forward_backward`] with the fused backward over several ranks: this rank's
    /// micro-batches before its last are accumulated as their segments' backwards end (under
    /// ZeRO-2 onto their owners, in rounds), its last
    /// one's forward runs, and the ranks agree that none ran out of memory and none met a
    /// non-finite loss (else all drop the step's gradients: retried split, or skipped, as one
    /// process would); then the last backward updates each segment's parameters from their sums
    /// over the ranks, the ranks meeting in rounds (a rank without a micro-batch answers them).
    /// Any error in that backward ends the run: part of the weights may have moved.
    pub(super) fn forward_backward_fused_across(
        &mut self,
        pieces: &[Piece<'_, T::Batch>],
        norm: LossNorm,
        lr: f64,
    ) -> Result<Local> {
        let mut out = Local::default();
        let Some(last) = self.last_forward_agreed(pieces, norm, &mut out)? else {
            return Ok(out);
        };
        let ranks = self.backward_ranks(self.acc.device().clone());
        self.updating = true;
        let f = self
            .opt
            .backward_and_step_across(self.checkpointer, last.as_ref(), lr, &mut self.acc, &ranks)
            .map_err(|e| {
                Error::Invalid(format!(
                    "rank {} of {}: {e} (in the fused backward, after the ranks began to \
                     update: the step cannot run again; resume from the last checkpoint)",
                    self.comm.rank(),
                    self.comm.world()
                ))
            })?;
        drop(last);
        out.updated_in_backward += f.updated_in_backward;
        out.non_finite_grads |= f.non_finite > 0;
        self.ledger.mark("backward", self.step)?;
        self.watch_budget("backward", true)?;
        Ok(out)
    }

    /// [`Self::forward_backward`] over several ranks without the fused backward: the step's
    /// micro-batches before this rank's last summed here, then the last one's backward sums
    /// the step's gradients over the ranks segment by segment (under ZeRO-1 onto their
    /// owners), once the ranks agree its forward went well everywhere. Under ZeRO-2,
    /// [`Self::forward_backward_sharded`].
    pub(super) fn forward_backward_reduced(
        &mut self,
        pieces: &[Piece<'_, T::Batch>],
        norm: LossNorm,
    ) -> Result<Local> {
        if self.opt.reduces_each_micro_batch() {
            return self.forward_backward_sharded(pieces, norm);
        }
        let mut out = Local::default();
        let Some(last) = self.last_forward_agreed(pieces, norm, &mut out)? else {
            return Ok(out);
        };
        self.backward_reduced(last)??;
        Ok(out)
    }

    /// This rank's micro-batches before its last (forward, and backward into the step's sums
    /// as each segment's ends; under ZeRO-2 onto their owners, in [`Self::sharded_rounds`]),
    /// its last one's forward, and the ranks' agreement that none ran
    /// out of memory and none met a non-finite loss (else all drop the step's gradients:
    /// retried split, or skipped, as one process would). The last scaled loss (None for a rank
    /// without a micro-batch), or None for it all when the step is skipped (`out.bad_loss`).
    fn last_forward_agreed(
        &mut self,
        pieces: &[Piece<'_, T::Batch>],
        norm: LossNorm,
        out: &mut Local,
    ) -> Result<Option<Option<Tensor>>> {
        let last = if self.opt.reduces_each_micro_batch() {
            // Under ZeRO-2 (the fused backward's path here) the micro-batches before each
            // rank's last go to their owners in rounds.
            let (earlier, last) = pieces.split_at(pieces.len().saturating_sub(1));
            match self.sharded_rounds(earlier, norm, out)? {
                None => return Ok(None),
                Some(Err(e)) => Err(e),
                Some(Ok(())) => match last.first() {
                    None => Ok(None),
                    Some(piece) => self.forward(piece, norm, out).inspect(|scaled| {
                        out.bad_loss |= scaled.is_none();
                    }),
                },
            }
        } else {
            self.all_but_last_backward(pieces, norm, out)
        };
        let (oom, bad) = match &last {
            Err(e) if e.is_out_of_memory() => (1u64, 0u64),
            // Any other error ends every rank (`ranks::main`).
            Err(_) => return last.map(Some),
            Ok(_) => (0, out.bad_loss as u64),
        };
        let mut shared = [oom, bad];
        self.comm.all_reduce_sum(&mut shared)?;
        if shared[0] > 0 || shared[1] > 0 {
            self.opt.discard_reduced();
            drop(self.acc.take());
        }
        if shared[0] > 0 {
            return Err(match last {
                Err(e) => e,
                Ok(_) => self.others_out_of_memory(shared[0]),
            });
        }
        if shared[1] > 0 {
            out.bad_loss = true;
            return Ok(None);
        }
        last.map(Some)
    }

    /// How this step's backward meets the other ranks, its sums put on `device`.
    fn backward_ranks(&self, device: candle_core::Device) -> BackwardRanks {
        BackwardRanks {
            comm: super::ranks::world,
            device,
            step: self.step + 1,
        }
    }

    /// One backward (`scaled`; None for a rank without a micro-batch, which answers the
    /// rounds) summed over the ranks as each segment's backward ends, into the accumulator.
    /// An out-of-memory error in any rank's backward comes back on every rank (the outer
    /// error: the step then splits); the inner one is this rank's `--fit` check of the
    /// backward's peak, which the ranks have yet to agree on.
    fn backward_reduced(&mut self, scaled: Option<Tensor>) -> Result<Result<()>> {
        let device = self
            .acc
            .pinned()
            .or_else(|| self.params.first().map(|p| p.device()))
            .cloned()
            .unwrap_or(candle_core::Device::Cpu);
        let ranks = self.backward_ranks(device);
        self.opt
            .backward_and_reduce_across(self.checkpointer, scaled, &mut self.acc, &ranks)?;
        self.account_gradients();
        // The backward's peak, with the sums over the ranks arriving.
        self.ledger.mark("backward", self.step)?;
        Ok(self.watch_budget("backward", false))
    }

    /// This rank's micro-batches but the last: forward, and backward into the step's sums as
    /// each segment's ends (the fused backward with accumulation); then the last one's forward,
    /// its scaled loss returned. None when this rank has no micro-batch, or a loss was not
    /// finite (`out.bad_loss`: the step's earlier gradients are dropped).
    fn all_but_last_backward(
        &mut self,
        pieces: &[Piece<'_, T::Batch>],
        norm: LossNorm,
        out: &mut Local,
    ) -> Result<Option<Tensor>> {
        let step = self.step;
        for (i, piece) in pieces.iter().enumerate() {
            let Some(scaled) = self.forward(piece, norm, out)? else {
                out.bad_loss = true;
                drop(self.acc.take());
                return Ok(None);
            };
            if i + 1 == pieces.len() {
                return Ok(Some(scaled));
            }
            self.opt
                .backward_and_accumulate(self.checkpointer, &scaled, &mut self.acc)?;
            drop(scaled);
            self.account_gradients();
            self.ledger.mark("backward", step)?;
            self.watch_budget("backward", false)?;
        }
        Ok(None)
    }

    /// [`Self::forward_backward`] under ZeRO-2 with several ranks: each micro-batch's
    /// gradients go to their owners segment by segment as its backward runs, and this rank's
    /// accumulator sums its own parameters' alone. The ranks go in rounds, one micro-batch
    /// each (a rank out of micro-batches answers the others' rounds), and agree after each
    /// round's forward (and the previous backward's `--fit` check) whether one ran out of
    /// memory or met a non-finite loss: all then stop the step together.
    fn forward_backward_sharded(
        &mut self,
        pieces: &[Piece<'_, T::Batch>],
        norm: LossNorm,
    ) -> Result<Local> {
        let mut out = Local::default();
        if let Some(over) = self.sharded_rounds(pieces, norm, &mut out)? {
            over?;
        }
        Ok(out)
    }

    /// ZeRO-2's rounds over `pieces` (this rank's micro-batches whose gradients go to their
    /// owners), one micro-batch a rank each, as many as the rank with the most has: each
    /// round's forward, the ranks' agreement, and its backward reduced onto the owners. None
    /// when some rank's loss was not finite (`out.bad_loss`: the step's sums dropped); else
    /// this rank's `--fit` check of its last backward, which the ranks have yet to agree on.
    fn sharded_rounds(
        &mut self,
        pieces: &[Piece<'_, T::Batch>],
        norm: LossNorm,
        out: &mut Local,
    ) -> Result<Option<Result<()>>> {
        self.opt.discard_reduced();
        let mut counts = vec![0u64; self.comm.world()];
        self.comm.all_gather(&[pieces.len() as u64], &mut counts)?;
        let rounds = counts.iter().copied().max().unwrap_or(0) as usize;
        // This rank's last backward passed the `--fit` budget: told at the next agreement.
        let mut over: Result<()> = Ok(());
        for round in 0..rounds {
            let piece = pieces.get(round).filter(|_| over.is_ok());
            let scaled = match piece {
                None => Ok(None),
                Some(piece) => self.forward(piece, norm, out),
            };
            let (scaled, oom, bad) = match scaled {
                Ok(s) => {
                    let bad = piece.is_some() && s.is_none();
                    (s, over.is_err(), bad)
                }
                Err(e) if e.is_out_of_memory() => {
                    over = Err(e);
                    (None, true, false)
                }
                // Any other error ends every rank (`ranks::main`).
                Err(e) => return Err(e),
            };
            let mut shared = [oom as u64, bad as u64];
            self.comm.all_reduce_sum(&mut shared)?;
            if shared[0] > 0 || shared[1] > 0 {
                self.opt.discard_reduced();
                drop(self.acc.take());
            }
            if shared[0] > 0 {
                over?;
                return Err(self.others_out_of_memory(shared[0]));
            }
            if shared[1] > 0 {
                // A non-finite loss on some rank: nothing of this step reaches the weights.
                out.bad_loss = true;
                return Ok(None);
            }
            over = self.backward_reduced(scaled)?;
        }
        Ok(Some(over))
    }

    /// After a step that stood: whether a rank's fused backward passed the CPU `--fit` budget
    /// (its `halve_next`), agreed over the ranks, so that every rank splits its next steps
    /// alike (one micro-batch size for the run: the one rank 0's checkpoint keeps, the one rank
    /// 0 logs). Nothing for one process or without `--fit`.
    pub(super) fn agree_on_halving(&mut self) -> Result<()> {
        let world = self.comm.world();
        // Only a fused backward's update stands before its budget is checked.
        if world == 1 || self.cfg.budget.is_none() || !self.cfg.mode.fused_backward() {
            return Ok(());
        }
        let mut passed = [u64::from(self.halve_next.is_some())];
        self.comm.all_reduce_sum(&mut passed)?;
        if passed[0] > 0 && self.halve_next.is_none() {
            self.halve_next = Some(format!(
                "out of memory in backward at step {} on {} of the {world} ranks: the fused \
                 backward passed the --fit budget (the update was applied)",
                self.step, passed[0]
            ));
        }
        Ok(())
    }

    /// Whether the parts of some rank's micro-batches split further: this rank's (`here`), or,
    /// with several ranks, any one's (every rank asks at once: see [`Self::halve`]).
    pub(super) fn any_rank_splits(&self, here: bool) -> Result<bool> {
        if self.comm.world() == 1 {
            return Ok(here);
        }
        let mut splits = [u64::from(here)];
        self.comm.all_reduce_sum(&mut splits)?;
        Ok(splits[0] > 0)
    }

    /// The error of a rank that did not run out of memory when `ranks` others did: every rank
    /// then drops the step and splits it alike.
    pub(super) fn others_out_of_memory(&self, ranks: u64) -> Error {
        Error::OutOfMemory {
            phase: "forward or backward".into(),
            step: self.step + 1,
            detail: format!(
                "{ranks} of the {} ranks ran out of memory",
                self.comm.world()
            ),
        }
    }
}
