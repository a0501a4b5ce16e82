//! The optimizer step as trainers see it: fp32 master weights, loss-scale check, clipping, update,
//! and the rounded write-back into the model's bf16/f16 weights.

use std::rc::Rc;

use candle_core::{DType, Device, Tensor, Var};
use ft_dist::Comm;
use ft_params::bytes::tensor_bytes;

use super::norm::{clip_factor, sum_of_squares};
use super::zero::Zero;
use super::{all_reduce_gradients, LossScaler, Precision, StatePlacement};
use crate::error::Result;
use crate::ledger::{Category, Ledger};
use crate::optim::Optimizer;

/// What one call to [`MixedOptimizer::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// False when the step was skipped: a gradient held inf or NaN.
    pub applied: bool,
    /// Global gradient norm before clipping (unscaled), when computed.
    pub grad_norm: Option<f64>,
    /// The step was skipped for a gradient that held inf or NaN with no loss scale to blame: the
    /// run's own values went non-finite (an f16 overflow under loss scaling is not this: the
    /// scale backs off and the next step goes on).
    pub non_finite: bool,
}

impl StepOutcome {
    /// A step taken with no gradient norm computed (the fused backward pass updates as it goes).
    pub fn applied_without_norm() -> Self {
        StepOutcome {
            applied: true,
            grad_norm: None,
            non_finite: false,
        }
    }

    /// A step skipped for a non-finite loss or gradient.
    pub fn skipped_non_finite() -> Self {
        StepOutcome {
            applied: false,
            grad_norm: None,
            non_finite: true,
        }
    }
}

/// Model parameters, their fp32 masters (when the model is stored in low precision), an
/// optimizer over the masters, an optional loss scaler and a clipping threshold.
pub struct MixedOptimizer {
    names: Vec<String>,
    pub(super) model: Vec<Var>,
    /// fp32 copies updated by the optimizer; empty when the model itself is fp32 and its state
    /// stays with it.
    pub(super) masters: Vec<Var>,
    placement: StatePlacement,
    pub(super) optimizer: Box<dyn Optimizer>,
    pub(super) scaler: Option<LossScaler>,
    pub(super) max_grad_norm: Option<f64>,
    /// ZeRO's partition of the state over a data-parallel run's ranks, when sharded.
    pub(super) zero: Option<Zero>,
    /// Without ZeRO: this step's gradients were summed over the ranks in its backward
    /// ([`MixedOptimizer::backward_and_reduce_across`]).
    reduced: bool,
}

/// What a checkpoint keeps of the optimizer ([`MixedOptimizer::state`]): its step count, the
/// loss scale and the state tensors by name.
pub type OptimizerState = (u64, f64, Vec<(String, Tensor)>);

/// Seed of the stochastic rounding of bf16 weights trained without masters.
const STOCHASTIC_ROUNDING_SEED: u64 = 0x5EED_0B16;

impl MixedOptimizer {
    /// The usual case: AdamW with `cfg` over `params` under `precision`, its state placed by
    /// `placement`, clipping at `max_grad_norm`.
    pub fn adamw(
        params: Vec<(String, Var)>,
        precision: Precision,
        placement: StatePlacement,
        cfg: crate::optim::AdamWConfig,
        max_grad_norm: Option<f64>,
    ) -> Result<Self> {
        Self::new(
            params,
            precision,
            placement,
            |n| Box::new(crate::optim::AdamW::new(n, cfg)),
            max_grad_norm,
        )
    }

    /// Wraps `params` (as listed by the `ParamStore`) under `precision`, with masters and
    /// optimizer state placed by `placement`. `make_optimizer` gets the number of parameters.
    pub fn new(
        params: Vec<(String, Var)>,
        precision: Precision,
        placement: StatePlacement,
        make_optimizer: impl FnOnce(usize) -> Box<dyn Optimizer>,
        max_grad_norm: Option<f64>,
    ) -> Result<Self> {
        let (names, model): (Vec<String>, Vec<Var>) = params.into_iter().unzip();
        let host = placement == StatePlacement::Host;
        let needs_master =
            host || (precision.master_weights && model.iter().any(|v| v.dtype() != DType::F32));
        let masters = if needs_master {
            model
                .iter()
                // `detach` first: an f32 parameter's `to_dtype(F32)` is the Var itself, and a
                // master must be a tensor of its own. Offloaded masters are cast on the host,
                // after a transfer of the weight's own bytes: nothing fp32 on the device.
                .map(|v| {
                    let w = v.as_tensor().detach();
                    let w = if host { w.to_device(&Device::Cpu)? } else { w };
                    Ok(Var::from_tensor(&w.to_dtype(DType::F32)?)?)
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let mut optimizer = make_optimizer(model.len());
        // Without masters, bf16 weights are what the optimizer writes: stochastically rounded
        // when the precision asks (a fixed seed here, the streams varying with the step and
        // parameter; the trainers set one from --seed through `CommonArgs::optimizer`).
        if precision.stochastic_rounding && masters.is_empty() {
            optimizer.set_stochastic_rounding(Some(STOCHASTIC_ROUNDING_SEED));
        }
        Ok(MixedOptimizer {
            names,
            model,
            masters,
            placement,
            optimizer,
            scaler: precision.loss_scaling.then(LossScaler::default),
            max_grad_norm,
            zero: None,
            reduced: false,
        })
    }

    /// Partitions the optimizer state and the fp32 masters over the ranks of `comm` (ZeRO
    /// `stage` 1, or 2 with the summed gradients too; see [`super::zero`]). Before any step or
    /// restored state: each rank then keeps and updates only its parameters' state, and frees
    /// the masters of the others.
    pub fn shard(&mut self, stage: u8, comm: Rc<Comm>) -> Result<()> {
        let sizes: Vec<usize> = self.model.iter().map(|v| v.elem_count()).collect();
        let zero = Zero::new(stage, comm, &sizes)?;
        for (i, m) in self.masters.iter_mut().enumerate() {
            if !zero.owns(i) {
                // An empty stand-in keeps the lists aligned: no update, state or write ever
                // reads it (this rank never holds the parameter's summed gradient).
                *m = Var::from_tensor(&Tensor::zeros(0, DType::F32, m.device())?)?;
            }
        }
        self.zero = Some(zero);
        Ok(())
    }

    /// The ZeRO stage (0: the state whole on every rank).
    pub fn zero_stage(&self) -> u8 {
        self.zero.as_ref().map_or(0, Zero::stage)
    }

    /// Whether each micro-batch's gradients are reduced to their owners as its backward ends
    /// (ZeRO-2 over several ranks), rather than the step's sums in its last backward.
    pub fn reduces_each_micro_batch(&self) -> bool {
        self.zero
            .as_ref()
            .is_some_and(Zero::reduces_each_micro_batch)
    }

    /// Records that a backward summed the parameters `present` over the ranks (some rank had
    /// their gradient): what the update then takes as it is.
    pub(super) fn note_reduced(&mut self, present: Vec<bool>) {
        match self.zero.as_mut() {
            Some(z) => z.note_reduced(present),
            None => self.reduced = true,
        }
    }

    /// Forgets the sums of a step that starts again or is skipped.
    pub fn discard_reduced(&mut self) {
        self.reduced = false;
        if let Some(z) = self.zero.as_mut() {
            z.discard_reduced();
        }
    }

    /// A step's accumulated `grads` summed over the ranks of `comm`, on `device`: whole on
    /// every rank, or under ZeRO each rank's share (`None` for parameters it does not own).
    /// Nothing travels when its backward summed them already.
    pub fn reduce_gradients(
        &mut self,
        comm: &Comm,
        grads: Vec<Option<Tensor>>,
        device: &Device,
    ) -> Result<Vec<Option<Tensor>>> {
        match self.zero.as_mut() {
            Some(z) => z.reduce(grads, &self.model, device),
            None if std::mem::take(&mut self.reduced) => Ok(grads),
            None => all_reduce_gradients(comm, grads, &self.model, device),
        }
    }

    /// The model's trainable parameters, in optimizer order.
    pub fn params(&self) -> &[Var] {
        &self.model
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The factor to multiply the loss by before backward (1 without loss scaling).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map(|s| s.scale).unwrap_or(1.0)
    }

    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// Leaves the parameters whose names `exempt` picks out of weight decay (HF Trainer:
    /// [`crate::optim::hf_trainer_no_decay`]); returns how many.
    pub fn exempt_from_weight_decay(&mut self, exempt: impl Fn(&str) -> bool) -> usize {
        let mask: Vec<bool> = self.names.iter().map(|n| exempt(n)).collect();
        let count = mask.iter().filter(|e| **e).count();
        self.optimizer.exempt_from_weight_decay(mask);
        count
    }

    pub fn optimizer_mut(&mut self) -> &mut dyn Optimizer {
        self.optimizer.as_mut()
    }

    /// fp32 master weights (empty when the model is fp32).
    pub fn masters(&self) -> &[Var] {
        &self.masters
    }

    /// The name of a model weight (or of its fp32 master) that holds inf or NaN, if one does:
    /// what a checkpoint must never hold.
    pub fn non_finite_weight(&self) -> Result<Option<String>> {
        let model = self.names.iter().zip(&self.model);
        let masters = self.names.iter().zip(&self.masters);
        let all = model
            .chain(masters)
            .map(|(n, v)| (n.as_str(), v.as_tensor()));
        Ok(super::norm::first_non_finite(all)?.map(|n| n.to_string()))
    }

    /// The weights the optimizer updates: the fp32 masters where there are some, else the
    /// model's own (what an EMA averages). Under ZeRO the masters of other ranks' parameters
    /// are empty here ([`MixedOptimizer::shard`]): a task reads its own rank's share (sdxl-ft's
    /// EMA is sharded the same way).
    pub fn weights(&self) -> &[Var] {
        if self.masters.is_empty() {
            &self.model
        } else {
            &self.masters
        }
    }

    /// Where the masters and optimizer state live.
    pub fn placement(&self) -> StatePlacement {
        self.placement
    }

    /// The device of the masters and optimizer state: the host when offloaded, else the
    /// model's (a checkpoint's optimizer state is restored there).
    pub fn state_device(&self) -> Device {
        match (self.placement, self.model.first()) {
            (StatePlacement::WithModel, Some(p)) => p.device().clone(),
            _ => Device::Cpu,
        }
    }

    /// Tells the ledger the bytes of parameters, master weights and optimizer state (the last
    /// two as host memory when offloaded).
    pub fn account(&self, ledger: &mut Ledger, component: &str) {
        ledger.set_tensors(
            Category::Parameters,
            component,
            self.model.iter().map(|v| v.as_tensor()),
        );
        let on = self.state_device();
        ledger.set_on(
            Category::MasterWeights,
            component,
            self.masters
                .iter()
                .map(|v| tensor_bytes(v.as_tensor()))
                .sum(),
            &on,
        );
        ledger.set_on(
            Category::OptimizerState,
            component,
            self.optimizer.state_bytes(),
            &on,
        );
    }

    /// Everything needed to resume exactly: fp32 masters (the bf16 weights alone lose the bits
    /// below their precision), optimizer moments, the optimizer's step count and the loss scale.
    pub fn state(&self) -> OptimizerState {
        let (t, mut tensors) = self.optimizer.state();
        for (i, m) in self.masters.iter().enumerate() {
            tensors.push((format!("master.{i}"), m.as_tensor().clone()));
        }
        (t, self.loss_scale(), tensors)
    }

    /// Writes [`MixedOptimizer::state`]'s tensors into one safetensors file at `path` (on rank
    /// 0; under ZeRO the other ranks send their shares in [`MixedOptimizer::send_state`] as it
    /// is written, one tensor at a time) and returns the step count, the loss scale and the
    /// tensors' names: what the checkpoint's `trainer_state.json` lists.
    pub fn write_state(&self, path: &std::path::Path) -> Result<(u64, f64, Vec<String>)> {
        let solo = ft_dist::Comm::solo();
        let (t, local) = self.local_state();
        let comm = self.zero.as_ref().map_or(&solo, |z| z.comm());
        let gathered = super::gather::gather(comm, local)?.ok_or_else(|| {
            crate::Error::Invalid("the optimizer state is written by rank 0 alone".into())
        })?;
        Ok((t, self.loss_scale(), gathered.write(path)?))
    }

    /// Under ZeRO, on every rank but 0 while rank 0 runs [`MixedOptimizer::write_state`]: sends
    /// this rank's share of the state. Without ZeRO rank 0 holds it all: nothing to send.
    pub fn send_state(&self) -> Result<()> {
        if let Some(z) = &self.zero {
            super::gather::gather(z.comm(), self.local_state().1)?;
        }
        Ok(())
    }

    /// The optimizer's step count and the state this rank holds: all of it, or under ZeRO its
    /// parameters' state and masters.
    fn local_state(&self) -> (u64, Vec<(String, Tensor)>) {
        let (t, mut local) = self.optimizer.state();
        let owns = |i: usize| self.zero.as_ref().is_none_or(|z| z.owns(i));
        for (i, m) in self.masters.iter().enumerate().filter(|(i, _)| owns(*i)) {
            local.push((format!("master.{i}"), m.as_tensor().clone()));
        }
        (t, local)
    }

    /// Restores what [`MixedOptimizer::state`] returned (the model weights are loaded separately).
    pub fn load_state(
        &mut self,
        step: u64,
        loss_scale: f64,
        tensors: &[(String, Tensor)],
    ) -> Result<()> {
        let own;
        let tensors = match &self.zero {
            Some(z) => {
                own = z.own_state(tensors);
                &own[..]
            }
            None => tensors,
        };
        self.optimizer.load_state(step, tensors)?;
        for (name, t) in tensors {
            if let Some(i) = name.strip_prefix("master.") {
                let i: usize = i.parse().map_err(|_| {
                    crate::Error::Invalid(format!("optimizer state `{name}`: bad index"))
                })?;
                // Without masters (an fp32 model whose state stays beside it) a saved master,
                // from a run with the state on the host, is the weight itself: set that.
                let target = if self.masters.is_empty() {
                    self.model.get(i)
                } else {
                    self.masters.get(i)
                };
                let m = target.ok_or_else(|| {
                    crate::Error::Invalid(format!("optimizer state `{name}`: no parameter {i}"))
                })?;
                m.set(&t.to_dtype(m.dtype())?.to_device(m.device())?)?;
            }
        }
        if let Some(s) = self.scaler.as_mut() {
            s.scale = loss_scale;
        }
        Ok(())
    }

    /// Applies one optimizer step with the summed, still loss-scaled gradients of the step. A
    /// gradient holding inf or NaN skips it: with f16 loss scaling the scale backs off (the
    /// usual overflow); without, the outcome says `non_finite` and the weights are untouched.
    pub fn step(&mut self, grads: Vec<Option<Tensor>>, lr: f64) -> Result<StepOutcome> {
        // The loss scale's inverse and clipping's factor are applied as the optimizer reads
        // each gradient: no fp32 or scaled copy of the gradients (of a single micro-batch's
        // f16/bf16 ones, or of the sums). One read-only sum of squares is the overflow check and
        // the norm; with a loss scale, a power of two, the norm and the factor have the bits of
        // unscaling first.
        let sq = match &self.zero {
            Some(z) => z.sum_of_squares(&grads)?,
            None => sum_of_squares(&grads)?,
        };
        let mut grad_mul = 1.0;
        let norm = if let Some(scaler) = self.scaler.as_mut() {
            let inv = 1.0 / scaler.scale;
            let found_inf = !sq.is_finite();
            scaler.update(found_inf);
            if found_inf {
                return Ok(StepOutcome {
                    applied: false,
                    grad_norm: None,
                    non_finite: false,
                });
            }
            grad_mul = inv;
            sq.sqrt() * inv
        } else {
            if !sq.is_finite() {
                return Ok(StepOutcome::skipped_non_finite());
            }
            sq.sqrt()
        };
        if let Some(max) = self.max_grad_norm {
            grad_mul *= clip_factor(norm, max);
        }
        let coef = grad_mul;
        if self.masters.is_empty() {
            self.optimizer.update(&self.model, &grads, lr, coef, None)?;
        } else {
            self.optimizer
                .update(&self.masters, &grads, lr, coef, Some(&self.model))?;
        }
        if let Some(z) = &self.zero {
            // The sums are spent: gone before the owners' weights travel, whose messages
            // would otherwise stand on top of them (the step's peak under ZeRO on the CPU).
            drop(grads);
            z.share_updates(&self.model)?;
        }
        Ok(StepOutcome {
            applied: true,
            grad_norm: Some(norm),
            non_finite: false,
        })
    }
}
