//! The fused backward pass (kohya's `--fused_backward_pass`): the update of each checkpointed
//! segment's parameters runs inside the backward, as soon as that segment's recomputation has
//! produced their gradients, and the gradients are dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{Tensor, Var};
use ft_params::checkpoint::{Checkpointer, EarlyStep};

use super::norm::{clip_factor, sum_of_squares_each};
use super::rounds::{locked, BackwardRanks, Rounds};
use super::{GradAccumulator, MixedOptimizer};
use crate::error::{Error, Result};
use crate::optim::{Optimizer, WriteRules};

impl MixedOptimizer {
    /// Backward and update in one pass (kohya's `--fused_backward_pass`): each parameter that
    /// one checkpointed segment uses is updated as soon as that segment's recomputation has
    /// produced its gradient, and the gradient is dropped, so the model's gradients never exist
    /// all at once (2 bytes per bf16 parameter: 4.8 GiB for the SDXL UNet); the others are
    /// updated after the backward. One micro-batch a step and no loss scaling, which the run's
    /// [`super::StepMode`] has ensured (the only way a fused backward pass is chosen); clipping, as in
    /// kohya's, is per tensor (each gradient's own norm against `max_grad_norm`; on a GPU the
    /// norms of a segment's tensors are read back together: one sync per segment, and one
    /// for the parameters outside them). Each
    /// parameter's update is the one `step` gives it, so without clipping the weights are those
    /// of `checkpointer.gradients` followed by `step`, bit for bit. With clipping, a tensor whose
    /// gradient holds inf or NaN is left as it is (its update skipped, counted in the outcome);
    /// without, the loop's check of the loss is the guard.
    ///
    /// With accumulation (`--accum` above 1), `sums` holds the step's earlier micro-batches'
    /// gradients ([`Self::backward_and_accumulate`]): each parameter steps from its sum plus this
    /// micro-batch's gradient, added as [`GradAccumulator`] adds them, so without clipping the
    /// update is that of plain accumulated training bit for bit; clipping is per tensor, on that
    /// summed gradient. A parameter with a sum but no gradient in this micro-batch steps from
    /// its sum after the backward. `sums` is empty when this returns.
    pub fn backward_and_step(
        &mut self,
        checkpointer: &Checkpointer,
        loss: &Tensor,
        lr: f64,
        sums: &mut GradAccumulator,
    ) -> Result<FusedOutcome> {
        self.fused_step(checkpointer, Some(loss), lr, sums, None)
    }

    /// [`Self::backward_and_step`] on one rank of a data-parallel run: each segment's
    /// gradients (with this rank's sums of the step's earlier micro-batches) are summed over the
    /// ranks as its backward ends, and every rank updates those parameters from the sums, so the
    /// ranks take the update one process takes over all their micro-batches (up to the order
    /// of the sums). The ranks meet in rounds ([`BackwardRanks`]): a rank without a micro-batch this
    /// step (`loss` None), or whose backward has ended, answers the others' rounds, offering
    /// nothing, until every rank's backward has ended. Every rank calls this at the same point
    /// of the step, once the ranks have agreed that every forward succeeded (a failed round
    /// cannot be taken back: any error here ends the run).
    ///
    /// Under ZeRO (1 or 2) each round's sums reach the owners alone, each owner updates its
    /// tensors (from its masters and optimizer state), and after the backward the owners send
    /// the updated weights to the other ranks ([`super::zero::Zero::share_updates`]). The
    /// step's earlier micro-batches' sums are each rank's own whole ones under stage 1 (each
    /// rank adds its own into what it offers); under stage 2 they were reduced onto their
    /// owners micro-batch by micro-batch (`sums` holds this rank's share), and each owner adds
    /// its own to the sums over the ranks as they arrive.
    pub fn backward_and_step_across(
        &mut self,
        checkpointer: &Checkpointer,
        loss: Option<&Tensor>,
        lr: f64,
        sums: &mut GradAccumulator,
        ranks: &BackwardRanks,
    ) -> Result<FusedOutcome> {
        self.fused_step(checkpointer, loss, lr, sums, Some(ranks.clone()))
    }

    fn fused_step(
        &mut self,
        checkpointer: &Checkpointer,
        loss: Option<&Tensor>,
        lr: f64,
        sums: &mut GradAccumulator,
        ranks: Option<BackwardRanks>,
    ) -> Result<FusedOutcome> {
        debug_assert!(self.scaler.is_none(), "StepMode refuses f16 here");
        debug_assert!(
            loss.is_some() || ranks.is_some(),
            "no backward and no ranks"
        );
        // The optimizer is lent to the early-step hook for the backward (it runs inside
        // candle's backprop), then taken back.
        let t0 = self.optimizer.state().0;
        let optimizer = std::mem::replace(&mut self.optimizer, Box::new(Lent::default()));
        let lent = Arc::new(Mutex::new(optimizer));
        let n = self.model.len();
        let stepper = ParamStepper {
            optimizer: lent.clone(),
            targets: if self.masters.is_empty() {
                self.model.clone()
            } else {
                self.masters.clone()
            },
            model: (!self.masters.is_empty()).then(|| self.model.clone()),
            t0,
            lr,
            max_grad_norm: self.max_grad_norm,
            non_finite: AtomicUsize::new(0),
            stepped: AtomicUsize::new(0),
            sums: Mutex::new(sums.take_whole()),
            owned: ranks.is_some() && self.reduces_each_micro_batch(),
            rounds: ranks.map(|ranks| {
                let owner = self.zero.as_ref().map(|z| z.owners().to_vec());
                Rounds::new(ranks, self.model.clone(), owner)
            }),
        };
        let stepper = Arc::new(stepper);
        let result = match loss {
            Some(loss) => {
                let hook = {
                    let stepper = stepper.clone();
                    self.early_hook(move |mine| stepper.step_all(mine))
                };
                checkpointer
                    .gradients_with(loss, &self.model, Some(hook))
                    .map_err(Error::from)
            }
            None => Ok((vec![None; n], 0)),
        };
        let rest = result.and_then(|(grads, taken)| {
            let rest: Vec<(usize, Tensor)> = grads
                .into_iter()
                .enumerate()
                .filter_map(|(i, g)| Some((i, g?)))
                .collect();
            let last = if stepper.owned {
                // The owners add their sums as the sums over the ranks arrive.
                rest
            } else {
                let mut last = locked(&stepper.sums).take_with_each(rest)?;
                // Sums of parameters this micro-batch gave no gradient: their own update.
                last.extend(locked(&stepper.sums).take_remaining());
                last
            };
            stepper.finish(last)?;
            // A step without any gradient still counts, as `step` counts it.
            if stepper.stepped.load(Ordering::Relaxed) == 0 {
                let mut opt = locked(&lent);
                opt.load_state(t0 + 1, &[])?;
            }
            Ok(taken)
        });
        let mut non_finite = stepper.non_finite.load(Ordering::Relaxed);
        let stepped = stepper.stepped.load(Ordering::Relaxed);
        // Whatever happened, the sums are spent (a failed step's are not reused).
        locked(&stepper.sums).take();
        let summed = stepper.rounds.as_ref().map(|r| (r.summed(), r.ranks.comm));
        // Take the optimizer back whatever happened (the hook was uninstalled with the backward).
        drop(stepper);
        let mut slot = locked(&lent);
        self.optimizer = std::mem::replace(&mut *slot, Box::new(Lent::default()));
        drop(slot);
        let updated_in_backward = rest?;
        if let (Some(z), Some((summed, comm))) = (self.zero.as_mut(), summed) {
            // The owners' updates to every rank; the skipped tensors counted over the owners,
            // so that every rank reports (and guards against) what one process would.
            z.set_present(summed);
            z.share_updates(&self.model)?;
            let mut count = [non_finite as u64, stepped as u64];
            comm()?.all_reduce_sum(&mut count)?;
            non_finite = count[0] as usize;
            // The step count one process would have: advanced when some owner updated a tensor
            // or no tensor had a gradient, else (every update skipped) not. A rank whose own
            // tensors were all skipped must not stay behind the others.
            let (skipped, offered) = (count[0], count[1]);
            let advanced = offered == 0 || offered > skipped;
            self.optimizer.load_state(t0 + advanced as u64, &[])?;
        }
        Ok(FusedOutcome {
            updated_in_backward,
            non_finite,
        })
    }
}

impl MixedOptimizer {
    /// The backward of a micro-batch before the step's last under a fused backward pass with
    /// accumulation: each segment's parameter gradients are added into `sums` as soon as that
    /// segment's backward ends, and dropped, so one micro-batch's gradients never exist all at
    /// once here either (the sums do: fp32 from the second micro-batch, on the host under
    /// `--offload-optimizer`). Returns how many gradients were added during the backward.
    pub fn backward_and_accumulate(
        &self,
        checkpointer: &Checkpointer,
        loss: &Tensor,
        sums: &mut GradAccumulator,
    ) -> Result<usize> {
        sums.reserve(self.model.len())?;
        let shared = Arc::new(Mutex::new(sums.take_whole()));
        let hook = {
            let shared = shared.clone();
            self.early_hook(move |mine| {
                let mut acc = locked(&shared);
                mine.into_iter().try_for_each(|(i, g)| acc.add_one(i, g))
            })
        };
        let result = checkpointer
            .gradients_with(loss, &self.model, Some(hook))
            .map_err(Error::from);
        // The hook went with the backward: the sums are ours again, whatever happened.
        *sums = locked(&shared).take_whole();
        let (grads, taken) = result?;
        for (i, g) in grads.into_iter().enumerate() {
            if let Some(g) = g {
                sums.add_one(i, g)?;
            }
        }
        sums.end_micro_batch();
        Ok(taken)
    }

    /// The early-step hook of a fused backward: the gradients of this optimizer's parameters
    /// go to `take` by parameter index, the others are handed back to the checkpointer.
    pub(super) fn early_hook(
        &self,
        take: impl Fn(Vec<(usize, Tensor)>) -> Result<()> + Send + Sync + 'static,
    ) -> EarlyStep {
        let index: HashMap<candle_core::TensorId, usize> = self
            .model
            .iter()
            .enumerate()
            .map(|(i, v)| (v.id(), i))
            .collect();
        Arc::new(
            move |grads: Vec<(Var, Tensor)>| -> candle_core::Result<Vec<(Var, Tensor)>> {
                let (mine, others): (Vec<_>, Vec<_>) = grads
                    .into_iter()
                    .partition(|(p, _)| index.contains_key(&p.id()));
                let mine = mine
                    .into_iter()
                    .filter_map(|(p, g)| Some((*index.get(&p.id())?, g)))
                    .collect();
                take(mine).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                Ok(others)
            },
        )
    }
}

/// What a fused backward pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedOutcome {
    /// Parameters updated during the backward (the rest after it).
    pub updated_in_backward: usize,
    /// Parameters whose update was skipped for a gradient holding inf or NaN.
    pub non_finite: usize,
}

/// One parameter's update at a time for a fused backward pass: every update of the step gets
/// the step count it would get in one `step` (the count is set back before each).
struct ParamStepper {
    optimizer: Arc<Mutex<Box<dyn Optimizer>>>,
    targets: Vec<Var>,
    model: Option<Vec<Var>>,
    t0: u64,
    lr: f64,
    max_grad_norm: Option<f64>,
    /// Updates skipped for a non-finite gradient.
    non_finite: AtomicUsize,
    /// Gradients this step has updated from (or skipped as non-finite).
    stepped: AtomicUsize,
    /// The step's earlier micro-batches' gradients (empty without accumulation): this rank's
    /// own, or (`owned`) their sums over the ranks of the parameters it owns.
    sums: Mutex<GradAccumulator>,
    /// Under ZeRO-2 over several ranks the earlier micro-batches' sums are the owners' (each
    /// micro-batch was reduced onto them): an owner adds its sum to the last micro-batch's sum
    /// over the ranks as that arrives, and the sums no rank's last micro-batch added to go
    /// round once more after the backward.
    owned: bool,
    /// With several ranks: each update waits for the sum over the ranks.
    rounds: Option<Rounds>,
}

impl ParamStepper {
    /// Updates parameter `i` from `g` for each `(i, g)` (a segment's, during the backward),
    /// with the step's earlier micro-batches' sums and, with several ranks, summed over them.
    fn step_all(&self, grads: Vec<(usize, Tensor)>) -> Result<()> {
        match &self.rounds {
            None => self.step_summed(locked(&self.sums).take_with_each(grads)?),
            Some(rounds) => {
                let mut grads = self.offered(grads)?;
                poisoned_on_purpose(rounds, &mut grads)?;
                let sums = self.round(rounds, grads, false)?.0;
                self.step_summed(self.arrived(sums)?)
            }
        }
    }

    /// What this rank offers of `grads`: with its own sums of the earlier micro-batches
    /// added, unless the owners hold those (`owned`).
    fn offered(&self, grads: Vec<(usize, Tensor)>) -> Result<Vec<(usize, Tensor)>> {
        if self.owned {
            return Ok(grads);
        }
        locked(&self.sums).take_with_each(grads)
    }

    /// The sums over the ranks that reached this rank, with its sums of the earlier
    /// micro-batches added where it owns them (`owned`).
    fn arrived(&self, sums: Vec<(usize, Tensor)>) -> Result<Vec<(usize, Tensor)>> {
        if !self.owned {
            return Ok(sums);
        }
        locked(&self.sums).take_with_each(sums)
    }

    /// One round of the rounds across ranks (where `FT_FAULT`'s `fused-round` fails): the sums
    /// this rank updates from, and whether every rank's backward has ended.
    fn round(
        &self,
        rounds: &Rounds,
        offered: Vec<(usize, Tensor)>,
        finished: bool,
    ) -> Result<(Vec<(usize, Tensor)>, bool)> {
        let rank = (rounds.ranks.comm)()?.rank();
        crate::fault::at("fused-round", rank, rounds.ranks.step)?;
        // This rank's earlier sums go round where they are not the owners' already.
        let earlier = (!self.owned).then_some(&self.sums);
        let round = rounds.round(offered, finished, false, earlier)?;
        Ok((round.sums, round.all_finished))
    }

    /// The step's last gradients (after the backward): updated from; with several ranks, then
    /// the rounds answered until every rank's backward has ended.
    fn finish(&self, grads: Vec<(usize, Tensor)>) -> Result<()> {
        let Some(rounds) = &self.rounds else {
            return self.step_summed(grads);
        };
        let mut offered = grads;
        loop {
            let (sums, all_finished) = self.round(rounds, std::mem::take(&mut offered), true)?;
            self.step_summed(self.arrived(sums)?)?;
            if all_finished {
                break;
            }
        }
        if self.owned {
            // The owners' sums of parameters no rank's last micro-batch gave a gradient: one
            // more round, every rank in it, so that every rank knows they were updated.
            let rest = locked(&self.sums).take_remaining();
            let (sums, _) = self.round(rounds, rest, true)?;
            self.step_summed(sums)?;
        }
        Ok(())
    }

    /// [`Self::step_all`] for gradients already summed over the step's micro-batches (and, with
    /// several ranks, over the ranks).
    fn step_summed(&self, grads: Vec<(usize, Tensor)>) -> Result<()> {
        let coefs: Vec<Option<f64>> = match self.max_grad_norm {
            Some(max) => {
                let gs: Vec<Tensor> = grads.iter().map(|(_, g)| g.clone()).collect();
                sum_of_squares_each(&gs)?
                    .into_iter()
                    .map(|sq| sq.is_finite().then(|| clip_factor(sq.sqrt(), max)))
                    .collect()
            }
            None => vec![Some(1.0); grads.len()],
        };
        self.stepped.fetch_add(grads.len(), Ordering::Relaxed);
        let mut opt = locked(&self.optimizer);
        let mut one: Vec<Option<Tensor>> = vec![None; self.targets.len()];
        for ((i, g), coef) in grads.into_iter().zip(coefs) {
            let Some(coef) = coef else {
                self.non_finite.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            one[i] = Some(g);
            opt.load_state(self.t0, &[])?;
            let done = opt.update(&self.targets, &one, self.lr, coef, self.model.as_deref());
            one[i] = None;
            done?;
        }
        Ok(())
    }
}

/// `FT_FAULT=nan-gradient:RANK:STEP`: the first tensor this rank offers in that step's rounds
/// made NaN (the tests of a non-finite gradient on one rank, whose tensor only its owner skips
/// under ZeRO).
fn poisoned_on_purpose(rounds: &Rounds, grads: &mut [(usize, Tensor)]) -> Result<()> {
    let Some((_, g)) = grads.first_mut() else {
        return Ok(());
    };
    let rank = (rounds.ranks.comm)()?.rank();
    if crate::fault::fires("nan-gradient", rank, rounds.ranks.step)? {
        *g = g.affine(f64::NAN, 0.0)?;
    }
    Ok(())
}

/// Stands in for the optimizer while a fused backward pass has lent it out.
#[derive(Default)]
struct Lent(WriteRules);

/// Every call is refused: nothing may update while the backward holds the optimizer.
impl Optimizer for Lent {
    fn n_params(&self) -> usize {
        0
    }
    fn step_host(&mut self, _: &[Var], _: &[Option<Tensor>], _: f64, _: f64) -> Result<()> {
        Err(lent())
    }
    fn update(
        &mut self,
        _: &[Var],
        _: &[Option<Tensor>],
        _: f64,
        _: f64,
        _: Option<&[Var]>,
    ) -> Result<()> {
        Err(lent())
    }
    fn state(&self) -> (u64, Vec<(String, Tensor)>) {
        (0, Vec::new())
    }
    fn load_state(&mut self, _: u64, _: &[(String, Tensor)]) -> Result<()> {
        Err(lent())
    }
    fn rules(&mut self) -> &mut WriteRules {
        &mut self.0
    }
}

fn lent() -> Error {
    Error::Invalid("the optimizer is lent to a fused backward pass".into())
}
