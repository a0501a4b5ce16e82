//! The step's paths that exist only with several ranks ([`super::step`] is the loop's step):
//! the fused backward across ranks (the ranks agree once after the last forward, then sum each
//! segment's gradients in rounds and update), ZeRO-2's micro-batch rounds (each micro-batch's
//! gradients reduced onto their owners as its backward ends), the error a rank reports when
//! others ran out of memory, and the agreement that all split the next steps when one's fused
//! backward passed the `--fit` budget.

use candle_core::Tensor;

use super::step::{Local, Loop, Piece};
use super::task::Task;
use crate::error::{Error, Result};
use crate::update::{FusedRanks, LossNorm};

impl<T: Task> Loop<'_, T> {
    /// [`Self::forward_backward`] with the fused backward over several ranks: this rank's
    /// micro-batches before its last are accumulated as their segments' backwards end, its last
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
        let last = self.all_but_last_backward(pieces, norm, &mut out);
        let (oom, bad) = match &last {
            Err(e) if e.is_out_of_memory() => (1u64, 0u64),
            // Any other error ends every rank (`ranks::main`).
            Err(_) => return last.map(|_| out),
            Ok(_) => (0, out.bad_loss as u64),
        };
        let mut shared = [oom, bad];
        self.comm.all_reduce_sum(&mut shared)?;
        if shared[0] > 0 {
            drop(self.acc.take());
            return Err(match last {
                Err(e) => e,
                Ok(_) => self.others_out_of_memory(shared[0]),
            });
        }
        if shared[1] > 0 {
            out.bad_loss = true;
            drop(self.acc.take());
            return Ok(out);
        }
        let ranks = FusedRanks {
            comm: super::ranks::world,
            device: self.acc.device().clone(),
            step: self.step + 1,
        };
        self.updating = true;
        let scaled = last?;
        let f = self
            .opt
            .backward_and_step_across(
                self.checkpointer,
                scaled.as_ref(),
                lr,
                &mut self.acc,
                &ranks,
            )
            .map_err(|e| {
                Error::Invalid(format!(
                    "rank {} of {}: {e} (in the fused backward, after the ranks began to \
                     update: the step cannot run again; resume from the last checkpoint)",
                    self.comm.rank(),
                    self.comm.world()
                ))
            })?;
        drop(scaled);
        out.updated_in_backward += f.updated_in_backward;
        out.non_finite_grads |= f.non_finite > 0;
        self.ledger.mark("backward", self.step)?;
        self.watch_budget("backward", true)?;
        Ok(out)
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
    /// gradients go to their owners as its backward ends, and this rank's accumulator sums
    /// its own parameters' alone. The ranks go in rounds, one micro-batch each (a rank out of
    /// micro-batches sends zeros), and agree after each round's backward, before its reduce,
    /// whether one ran out of memory or met a non-finite loss: all then stop the step together.
    pub(super) fn forward_backward_sharded(
        &mut self,
        pieces: &[Piece<'_, T::Batch>],
        norm: LossNorm,
    ) -> Result<Local> {
        let step = self.step;
        self.opt.discard_reduced();
        let mut counts = vec![0u64; self.comm.world()];
        self.comm.all_gather(&[pieces.len() as u64], &mut counts)?;
        let rounds = counts.iter().copied().max().unwrap_or(0) as usize;
        let device = self
            .acc
            .pinned()
            .or_else(|| self.params.first().map(|p| p.device()))
            .cloned()
            .unwrap_or(candle_core::Device::Cpu);
        let mut out = Local::default();
        for round in 0..rounds {
            let grads = match pieces.get(round) {
                None => Ok(Some(vec![None; self.params.len()])),
                Some(piece) => self.forward(piece, norm, &mut out).and_then(|scaled| {
                    let Some(scaled) = scaled else {
                        return Ok(None);
                    };
                    let grads = self.checkpointer.gradients(&scaled, &self.params)?;
                    drop(scaled);
                    self.ledger.mark("backward", step)?;
                    self.watch_budget("backward", false)?;
                    Ok(Some(grads))
                }),
            };
            let (oom, bad) = match &grads {
                Err(e) if e.is_out_of_memory() => (1u64, 0u64),
                Err(_) => return grads.map(|_| out),
                Ok(g) => (0, g.is_none() as u64),
            };
            let mut shared = [oom, bad];
            self.comm.all_reduce_sum(&mut shared)?;
            if shared[0] > 0 || shared[1] > 0 {
                self.opt.discard_reduced();
                drop(self.acc.take());
            }
            if shared[0] > 0 {
                return Err(match grads {
                    Err(e) => e,
                    Ok(_) => self.others_out_of_memory(shared[0]),
                });
            }
            if shared[1] > 0 {
                // A non-finite loss on some rank: nothing of this step reaches the weights.
                out.bad_loss = true;
                break;
            }
            let grads = grads?.unwrap_or_default();
            let mine = self.opt.reduce_micro_batch(grads, &device)?;
            self.acc.add(mine)?;
            self.account_gradients();
            // The reduce's own peak (its buckets, the sums arriving) and this rank's sums.
            self.ledger.mark("backward", step)?;
        }
        Ok(out)
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
