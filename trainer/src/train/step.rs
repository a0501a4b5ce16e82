//! One optimizer step of the loop: its micro-batches gathered (this rank's share of a
//! data-parallel step), each forward under the checkpointer, the backward and the update as the
//! [`crate::update::StepMode`] says, the ranks' agreement and gradient sum before the update, and
//! the out-of-memory retry that splits the micro-batches; the run's state between steps
//! ([`Loop`]) and where it stands for a checkpoint. The paths only several ranks take are in
//! [`super::step_ranks`].

use std::rc::Rc;

use candle_core::{DType, Tensor, Var};
use ft_dist::Comm;
use ft_params::bytes::format_bytes;
use ft_params::checkpoint::Checkpointer;

use super::eval::Best;
use super::saved::{save_checkpoint, Progress, Split};
use super::settings::LoopConfig;
use super::task::{StepCtx, Task, Units};
use crate::error::{Error, Result};
use crate::ledger::{measure, Category, Ledger};
use crate::update::{GradAccumulator, LossNorm, MixedOptimizer, StepOutcome};
/// The seed of one micro-batch's dropout masks: a function of (run seed, step, micro) only.
fn mix(seed: u64, step: u64, micro: usize) -> u64 {
    let mut r = ft_params::rng::SplitMix64::new(
        seed ^ step.wrapping_mul(0x9E37_79B9) ^ ((micro as u64) << 48),
    );
    r.next_u64()
}

/// What one step did, for its metrics line.
pub(super) struct StepReport {
    /// The loss was inf or NaN: the step was skipped before its backward.
    pub(super) bad_loss: bool,
    pub(super) loss: f64,
    pub(super) lr: f64,
    pub(super) samples: usize,
    pub(super) outcome: StepOutcome,
    /// Parameters updated during the backward (a fused backward pass).
    pub(super) updated_in_backward: usize,
    /// Forward and backward passes the step ran (its micro-batches, or their parts).
    pub(super) pieces: usize,
}

/// What one rank's forward and backward passes of a step gave.
#[derive(Default)]
pub(super) struct Local {
    pub(super) loss_sum: f64,
    pub(super) bad_loss: bool,
    pub(super) updated_in_backward: usize,
    pub(super) non_finite_grads: bool,
}

/// The state of a run between steps.
pub(super) struct Loop<'a, T: Task> {
    /// The run's ranks (one process: a world of one).
    pub(super) comm: Rc<Comm>,
    pub(super) task: &'a mut T,
    pub(super) opt: &'a mut MixedOptimizer,
    pub(super) checkpointer: &'a Checkpointer,
    pub(super) ledger: &'a mut Ledger,
    pub(super) cfg: &'a LoopConfig,
    pub(super) params: Vec<Var>,
    pub(super) acc: GradAccumulator,
    pub(super) step: u64,
    pub(super) epoch: usize,
    /// Times each micro-batch is halved, after out-of-memory retries (0: whole); a resumed run
    /// starts where its checkpoint's was, at the same micro-batch size.
    pub(super) halvings: u32,
    /// The step's update has begun (the optimizer step, or the fused backward's): an
    /// out-of-memory error from here on cannot be retried (part of the weights has moved).
    pub(super) updating: bool,
    /// The step's update was applied in the fused backward and the CPU budget was passed: the
    /// next steps are split, this one stands.
    pub(super) halve_next: Option<String>,
    /// What happened on the way (out-of-memory retries), for metrics.jsonl and the reader.
    pub(super) events: Vec<serde_json::Value>,
}

/// A part of a step's micro-batch: the micro-batch it comes from (its index in the step over all
/// ranks), the position of its first sample there, and the samples (the micro-batch itself
/// until an out-of-memory retry splits it).
pub(super) struct Piece<'b, B> {
    micro: usize,
    first: usize,
    pub(super) batch: Part<'b, B>,
}

pub(super) enum Part<'b, B> {
    Whole(&'b B),
    Split(B),
}

impl<B> Part<'_, B> {
    pub(super) fn get(&self) -> &B {
        match self {
            Part::Whole(b) => b,
            Part::Split(b) => b,
        }
    }
}

impl<T: Task> Loop<'_, T> {
    /// One optimizer step: gather, forward and backward each micro-batch, update. Out of memory
    /// in a forward or backward: the step's tensors are dropped, each micro-batch is split in
    /// two more parts (the same samples, the loss normalised over the same units), and the step
    /// runs again; the later steps keep the split.
    pub(super) fn train_step(&mut self) -> Result<StepReport> {
        let batches = self.gather()?;
        loop {
            let attempt = self
                .pieces(&batches, self.halvings)
                .and_then(|pieces| self.attempt(&pieces));
            match attempt {
                Ok(r) => {
                    // The step stands (its update is applied): the next ones split, if they can
                    // (on every rank, if one's passed the budget).
                    self.agree_on_halving()?;
                    if let Some(why) = self.halve_next.take() {
                        self.halve(&batches, why, self.step, true)?;
                    }
                    return Ok(r);
                }
                Err(e) if e.is_out_of_memory() => {
                    self.halve(&batches, e.to_string(), self.step + 1, false)?
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The micro-batches halved `halvings` times (a part of one sample stays whole).
    fn pieces<'b>(
        &self,
        batches: &'b [(usize, T::Batch)],
        halvings: u32,
    ) -> Result<Vec<Piece<'b, T::Batch>>> {
        let mut out = Vec::new();
        for (micro, b) in batches.iter().map(|(m, b)| (*m, b)) {
            let mut parts = vec![Piece {
                micro,
                first: 0,
                batch: Part::Whole(b),
            }];
            for _ in 0..halvings {
                let mut next = Vec::with_capacity(parts.len() * 2);
                for p in parts {
                    match self.task.split(p.batch.get()).map_err(Error::Task)? {
                        Some((x, y)) => {
                            let second = p.first + self.task.counts(&x).1;
                            next.push(Piece {
                                micro,
                                first: p.first,
                                batch: Part::Split(x),
                            });
                            next.push(Piece {
                                micro,
                                first: second,
                                batch: Part::Split(y),
                            });
                        }
                        None => next.push(p),
                    }
                }
                parts = next;
            }
            out.extend(parts);
        }
        Ok(out)
    }

    /// After an out-of-memory error (`why`) in `step`: drops what the step holds and splits
    /// each micro-batch once more, or stops with the memory table of the moment when the parts
    /// are single samples already on every rank (or the update had begun). When the step `stood` (its update
    /// applied before the budget was found passed), parts that cannot split further are left
    /// as they are: the run goes on, and the next step that passes the budget stops it.
    fn halve(
        &mut self,
        batches: &[(usize, T::Batch)],
        why: String,
        step: u64,
        stood: bool,
    ) -> Result<()> {
        let was_updating = std::mem::replace(&mut self.updating, false);
        self.opt.discard_reduced();
        drop(self.acc.take());
        self.ledger.remove(Category::Gradients, "model");
        self.ledger
            .remove(Category::Activations, "checkpoint inputs");
        let before = self.pieces(batches, self.halvings)?.len();
        let after = self.pieces(batches, self.halvings + 1)?.len();
        // With several ranks, every rank splits when any one's parts can (one whose parts
        // cannot, or that has none this step, keeps them whole), so that the ranks keep one
        // micro-batch size. Every rank is here at once (an out-of-memory error or a split
        // they agreed on), except once this rank's update has begun: that ends the run.
        let splits = if was_updating {
            after > before
        } else {
            self.any_rank_splits(after > before)?
        };
        if stood && !splits {
            return Ok(());
        }
        if was_updating || !splits {
            self.ledger.mark("out-of-memory", self.step)?;
            let device = self.params.first().map(|p| p.device().clone());
            let allocator = device
                .as_ref()
                .and_then(measure::allocator_summary)
                .map(|s| format!("{s}\n"))
                .unwrap_or_default();
            let why_not = if was_updating {
                "the step's update had begun (part of the weights had moved), so the step \
                 cannot run again; resume from the last checkpoint with a smaller --batch-size \
                 and a larger --accum, or the optimizer state on the host (--offload-optimizer)"
                    .to_string()
            } else {
                format!(
                    "the step already runs {after} micro-batches of the smallest size they split \
                     to; lower the resolution, the sequence lengths or the episode size, or \
                     checkpoint more (--checkpointing full, full-host)"
                )
            };
            return Err(Error::Invalid(format!(
                "{why}: {why_not}. Nothing saved was touched.\nmemory at that moment:\n{allocator}{}",
                self.ledger.table()
            )));
        }
        self.halvings += 1;
        self.events.push(serde_json::json!({
            "step": step,
            "event": "out_of_memory",
            "error": why,
            "micro_batches_before": before,
            "micro_batches_after": after,
            "message": format!(
                "{why}; each micro-batch is split once more ({before} -> {after} forward and \
                 backward passes a step, the same samples and effective batch)"
            ),
        }));
        Ok(())
    }

    /// On the CPU under `--fit`: an out-of-memory error when the phase that just ended peaked
    /// above the budget (as the plan counts bytes), or, once the fused backward has applied the
    /// update, a note that the next steps split.
    pub(super) fn watch_budget(&mut self, phase: &str, applied: bool) -> Result<()> {
        let Some(budget) = self.cfg.budget else {
            return Ok(());
        };
        if !self.ledger.is_measured() || !self.params.first().is_none_or(|p| p.device().is_cpu()) {
            return Ok(());
        }
        let Some(peak) = self.ledger.last_peak_as_planned() else {
            return Ok(());
        };
        let point = format!("fit-budget-{phase}");
        let forced = crate::fault::fires(&point, self.comm.rank(), self.step + 1)?;
        if peak <= budget && !forced {
            return Ok(());
        }
        let detail = format!(
            "the {phase} peaked at {}, {} the --fit budget of {}",
            format_bytes(peak as i64),
            if forced {
                "taken by FT_FAULT to be over"
            } else {
                "over"
            },
            format_bytes(budget as i64)
        );
        if applied {
            self.halve_next = Some(format!(
                "out of memory in {phase} at step {}: {detail} (the update was applied)",
                self.step + 1
            ));
            return Ok(());
        }
        Err(Error::OutOfMemory {
            phase: phase.to_string(),
            step: self.step + 1,
            detail,
        })
    }

    /// One try at the step over this rank's `pieces`: their forward and backward passes, then,
    /// once the ranks agree that none ran out of memory and none had a non-finite loss, the
    /// gradients summed over the ranks and the update.
    fn attempt(&mut self, pieces: &[Piece<'_, T::Batch>]) -> Result<StepReport> {
        let step = self.step;
        // The step's units and samples over all ranks: the loss is their mean.
        let mut totals = [0u64; 2];
        for p in pieces {
            let (units, samples) = self.task.counts(p.batch.get());
            totals[0] += units as u64;
            totals[1] += samples as u64;
        }
        self.comm.all_reduce_sum(&mut totals)?;
        let norm = match self.cfg.units {
            Units::Tokens => LossNorm::Tokens(totals[0] as usize),
            Units::Samples => LossNorm::Samples(totals[0] as usize),
        };
        let lr = self.cfg.schedule.lr_at(step);
        let fused = self.cfg.mode.fused_backward();
        let mut local = match self.forward_backward(pieces, norm, lr) {
            Ok(l) => Ok(l),
            // One process retries at once; ranks first agree that one of them must.
            Err(e) if e.is_out_of_memory() && self.comm.world() > 1 => Err(e),
            Err(e) => return Err(e),
        };
        if self.comm.world() > 1 {
            let (oom, bad, loss) = match &local {
                Ok(l) => (0.0, l.bad_loss as u8 as f64, l.loss_sum),
                Err(_) => (1.0, 0.0, 0.0),
            };
            let mut shared = [oom, bad, loss];
            self.comm.all_reduce_sum(&mut shared)?;
            if shared[0] > 0.0 {
                self.opt.discard_reduced();
                drop(self.acc.take());
                return Err(match local {
                    Err(e) => e,
                    Ok(_) => self.others_out_of_memory(shared[0] as u64),
                });
            }
            if let Ok(l) = &mut local {
                // A non-finite loss on any rank: no rank updates.
                if shared[1] > 0.0 && !l.bad_loss {
                    l.bad_loss = true;
                    self.opt.discard_reduced();
                    drop(self.acc.take());
                }
                l.loss_sum = shared[2];
            }
        }
        let local = local?;
        let outcome = if local.bad_loss {
            StepOutcome::skipped_non_finite()
        } else if fused {
            StepOutcome {
                non_finite: local.non_finite_grads,
                ..StepOutcome::applied_without_norm()
            }
        } else {
            let device = self.acc.device().clone();
            let mut grads = self.acc.take();
            if grads.is_empty() {
                // A rank without micro-batches (a short last step of an epoch) adds zeros.
                grads = vec![None; self.params.len()];
            }
            let grads = self.opt.reduce_gradients(&self.comm, grads, &device)?;
            self.updating = true;
            self.opt.step(grads, lr)?
        };
        self.ledger.remove(Category::Gradients, "model");
        self.ledger
            .remove(Category::Activations, "checkpoint inputs");
        self.opt.account(self.ledger, "model");
        self.step += 1;
        self.task
            .after_step(self.step, self.opt.weights(), self.ledger)
            .map_err(Error::Task)?;
        self.ledger.mark("step", self.step)?;
        self.updating = false;
        Ok(StepReport {
            bad_loss: local.bad_loss,
            loss: local.loss_sum,
            lr,
            samples: totals[1] as usize,
            outcome,
            updated_in_backward: local.updated_in_backward,
            pieces: pieces.len(),
        })
    }

    /// This rank's forward and backward passes over `pieces`, the loss normalised by `norm`;
    /// with the fused backward, the last one updates the weights at `lr`.
    fn forward_backward(
        &mut self,
        pieces: &[Piece<'_, T::Batch>],
        norm: LossNorm,
        lr: f64,
    ) -> Result<Local> {
        // The fused backward first: under ZeRO its rounds reach the owners themselves.
        let fused = self.cfg.mode.fused_backward();
        if fused && self.comm.world() > 1 {
            return self.forward_backward_fused_across(pieces, norm, lr);
        }
        if self.comm.world() > 1 {
            return self.forward_backward_reduced(pieces, norm);
        }
        let step = self.step;
        let mut out = Local::default();
        for (i, piece) in pieces.iter().enumerate() {
            let Some(scaled) = self.forward(piece, norm, &mut out)? else {
                // Nothing of this step reaches the weights: no backward, and the gradients of
                // its earlier micro-batches are dropped.
                out.bad_loss = true;
                drop(self.acc.take());
                break;
            };
            let last = i + 1 == pieces.len();
            if fused && !last {
                // Each segment's gradients into the step's sums as its backward ends.
                self.opt
                    .backward_and_accumulate(self.checkpointer, &scaled, &mut self.acc)?;
                drop(scaled);
                self.account_gradients();
            } else if fused {
                // Backward and update together: no gradients of the whole model at once.
                self.updating = true;
                let f =
                    self.opt
                        .backward_and_step(self.checkpointer, &scaled, lr, &mut self.acc)?;
                out.updated_in_backward += f.updated_in_backward;
                out.non_finite_grads |= f.non_finite > 0;
            } else if self.checkpointer.strategy().segmented() {
                // Each segment's gradients into the step's sums (or, under
                // --offload-optimizer, to the host) as its backward ends: the same sums, and a
                // micro-batch's gradients never whole beside them.
                self.opt
                    .backward_and_accumulate(self.checkpointer, &scaled, &mut self.acc)?;
                drop(scaled);
                self.account_gradients();
            } else {
                let grads = self.checkpointer.gradients(&scaled, &self.params)?;
                drop(scaled);
                self.acc.add(grads)?;
                self.account_gradients();
            }
            self.ledger.mark("backward", step)?;
            self.watch_budget("backward", fused && last)?;
        }
        Ok(out)
    }

    /// One piece's forward pass: its loss, normalised by `norm` and added to `out`, scaled by
    /// the loss scale for its backward; `None` when the loss is not finite.
    pub(super) fn forward(
        &mut self,
        piece: &Piece<'_, T::Batch>,
        norm: LossNorm,
        out: &mut Local,
    ) -> Result<Option<Tensor>> {
        let step = self.step;
        let ctx = StepCtx {
            step,
            micro: piece.micro,
            dropout_seed: mix(self.cfg.seed, step, piece.micro),
            first_sample: piece.first,
            checkpointer: self.checkpointer,
        };
        self.checkpointer.begin_forward();
        let summed = self
            .task
            .summed_loss(piece.batch.get(), &ctx)
            .map_err(Error::Task)?;
        let loss = norm.scale(&summed)?;
        let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        out.loss_sum += value;
        // `--checkpointing full-host`: the tensors between segments, in host memory.
        let host = self.checkpointer.host_bytes();
        if host > 0 {
            self.ledger.set_on(
                Category::Activations,
                "checkpoint inputs",
                host,
                &candle_core::Device::Cpu,
            );
        }
        self.ledger.mark("forward", step)?;
        self.watch_budget("forward", false)?;
        if !value.is_finite() {
            return Ok(None);
        }
        Ok(Some(if self.opt.loss_scale() != 1.0 {
            (loss * self.opt.loss_scale())?
        } else {
            loss
        }))
    }

    /// The accumulator's bytes, as the ledger's gradients.
    pub(super) fn account_gradients(&mut self) {
        let (bytes, device) = (self.acc.bytes(), self.acc.device().clone());
        self.ledger
            .set_on(Category::Gradients, "model", bytes, &device);
    }

    /// The step's micro-batches of this rank, gathered first (the loss is normalised by all of
    /// their units), each with its index in the step: of the step's `accum x world`
    /// micro-batches, rank `r` takes the `r`-th, `r + world`-th, ...; the others are passed
    /// over. A short last step of an epoch stays short, like a DataLoader's last batch (a rank
    /// may then have none).
    fn gather(&mut self) -> Result<Vec<(usize, T::Batch)>> {
        let (rank, world) = (self.comm.rank(), self.comm.world());
        let want = self.cfg.mode.micro_batches() * world;
        let mut batches = Vec::with_capacity(want.div_ceil(world));
        let (mut taken, mut fresh_epochs) = (0, 0);
        while taken < want {
            let got = if taken % world == rank {
                match self.task.next_batch().map_err(Error::Task)? {
                    Some(b) => {
                        batches.push((taken, b));
                        true
                    }
                    None => false,
                }
            } else {
                self.task.skip_batch().map_err(Error::Task)?
            };
            if got {
                taken += 1;
            } else if taken > 0 {
                break;
            } else {
                fresh_epochs += 1;
                if fresh_epochs > 1 {
                    return Err(Error::Invalid("the training data yields no batch".into()));
                }
                self.epoch += 1;
                self.task.start_epoch(self.epoch).map_err(Error::Task)?;
            }
        }
        Ok(batches)
    }

    /// Where the run is, for a checkpoint.
    pub(super) fn progress(&self, best: &Best) -> Progress {
        Progress {
            step: self.step,
            epoch: self.epoch,
            best: best.state(),
            split: (self.halvings > 0).then_some(Split {
                halvings: self.halvings,
                batch_size: self.cfg.batch_size,
            }),
        }
    }

    /// Saves `checkpoint-{step}` and returns its folder.
    pub(super) fn save(&mut self, best: &Best) -> Result<std::path::PathBuf> {
        let name = format!("checkpoint-{}", self.step);
        self.save_as(best, &name)
    }

    /// Saves the checkpoint folder `name` in the output folder: every rank calls it, rank 0
    /// writes it while the others send what they alone hold (a share of the EMA, of the
    /// optimizer state under ZeRO), and they wait until it is written.
    pub(super) fn save_as(&mut self, best: &Best, name: &str) -> Result<std::path::PathBuf> {
        let dir = self.cfg.output_dir.join(name);
        if self.comm.is_main() {
            save_checkpoint(self.task, self.opt, &self.progress(best), &dir)?;
        } else {
            self.task.serve_save().map_err(Error::Task)?;
            self.opt.send_state()?;
        }
        self.comm.barrier();
        // The save's own peak (rank 0 writes the other ranks' shares as they arrive).
        self.ledger.mark("save", self.step)?;
        Ok(dir)
    }
}
