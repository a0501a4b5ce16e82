//! Optimizers: the update rules and their state, nothing else.
//!
//! An optimizer implements its math ([`Optimizer::step_host`], and on a GPU
//! [`Optimizer::step_fused`] where it has kernels) and its state ([`Optimizer::state`],
//! [`Optimizer::load_state`]); [`Optimizer::update`], the one entry point the update layer
//! calls, is provided: it checks the lists, picks the fused CUDA kernels or the host update
//! (`fused`), and writes updated fp32 masters into the model's low-precision weights (`write`).
//! They update the tensors they are given: the fp32 master weights when the model is stored in
//! bf16/f16, the model's own `Var`s otherwise.
//!
//! - [`adamw`], [`sgd`], [`adamw8bit`], [`adafactor`]: one file per optimizer, each with its
//!   [`OptimSpec`] (what `--optim` names, state bytes for the plan, what it needs on a GPU);
//!   [`registry`] lists them.
//! - `host_adamw`: AdamW's per-element arithmetic and its one threaded pass on the CPU.
//! - [`rules`]: stochastic rounding and weight-decay exemptions, the same for every optimizer.
//! - `state`: checkpoint names of per-parameter state; `write`: writing updated weights.

pub mod adafactor;
pub mod adamw;
pub mod adamw8bit;
#[cfg(feature = "cuda")]
mod fused;
mod host_adamw;
pub mod registry;
pub mod rules;
pub mod sgd;
mod spec;
mod state;
mod write;

pub use adamw::{AdamW, AdamWConfig};
pub use rules::{hf_trainer_no_decay, WriteRules};
pub use sgd::Sgd;
pub use spec::{OptimSettings, OptimSpec};

use candle_core::{Tensor, Var};

use crate::error::Result;

/// An optimizer over a fixed list of parameters.
pub trait Optimizer: Send {
    /// How many parameters it was built for (one state slot each).
    fn n_params(&self) -> usize;

    /// Updates `params` with `grads` (same order; `None` leaves a parameter untouched, as
    /// PyTorch does for a parameter whose `.grad` is None) at learning rate `lr`, every gradient
    /// multiplied by `grad_mul` as it is read (a clipping factor, or 1 for none: the same bits
    /// as scaling fp32 copies first, without the copies), with candle's ops or a threaded pass
    /// on the host. Advances the step count.
    fn step_host(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
    ) -> Result<()>;

    /// Whether this optimizer's own CUDA kernels compute its update in its configuration.
    #[cfg(feature = "cuda")]
    fn has_kernels(&self) -> bool {
        false
    }

    /// [`Optimizer::step_host`] in this crate's CUDA kernels, for contiguous CUDA parameters,
    /// writing `model` (the bf16/f16 weights the masters `params` shadow) in the same pass when
    /// given. Called only where [`Optimizer::has_kernels`] says so.
    #[cfg(feature = "cuda")]
    fn step_fused(
        &mut self,
        _params: &[Var],
        _grads: &[Option<Tensor>],
        _lr: f64,
        _grad_mul: f64,
        _model: Option<&[Var]>,
    ) -> Result<()> {
        Err(crate::Error::Invalid(
            "this optimizer has no CUDA kernels".into(),
        ))
    }

    /// State tensors with stable names, for checkpoints (`exp_avg.3`, ...) and the step count.
    /// They share storage with the live state (no copy of gigabytes of moments to save them),
    /// which the fused CUDA step and AdamW's host pass update in place: write them out before
    /// the next step.
    fn state(&self) -> (u64, Vec<(String, Tensor)>);
    /// Restores what [`Optimizer::state`] returned.
    fn load_state(&mut self, step: u64, tensors: &[(String, Tensor)]) -> Result<()>;

    /// How this optimizer writes weights and which ones decay: what the two setters below
    /// change, kept in one [`WriteRules`] by every optimizer.
    fn rules(&mut self) -> &mut WriteRules;

    /// One update (see [`Optimizer::step_host`]). With `model`, `params` are fp32 masters and
    /// each updated one is then written into `model[i]`, the bf16/f16 weight the forward reads
    /// (on the model's device: the masters may live on the host), in the same pass where a
    /// kernel can. Only parameters with a gradient are updated and written. Takes the fused CUDA
    /// kernels where the optimizer has them and every stepped parameter is a contiguous CUDA
    /// tensor they take, the host update otherwise.
    fn update(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
        model: Option<&[Var]>,
    ) -> Result<()> {
        state::check_len(params, grads, self.n_params())?;
        #[cfg(feature = "cuda")]
        if self.has_kernels() {
            if let Some(into) = fused::fused_path(params, grads, model) {
                self.step_fused(params, grads, lr, grad_mul, into)?;
                return write::finish(params, grads, model, into.is_some());
            }
        }
        self.step_host(params, grads, lr, grad_mul)?;
        write::finish(params, grads, model, false)
    }

    /// Bytes of optimizer state held now.
    fn state_bytes(&self) -> u64 {
        self.state()
            .1
            .iter()
            .map(|(_, t)| ft_params::bytes::tensor_bytes(t))
            .sum()
    }

    /// Write bf16 parameters with stochastic rounding from `seed` (a different stream per
    /// step and parameter, the same after a resume), or to nearest with `None`: for bf16
    /// weights trained without fp32 masters ([`crate::update::Precision::full_bf16`]).
    fn set_stochastic_rounding(&mut self, seed: Option<u64>) {
        self.rules().sr = seed;
    }

    /// Parameters weight decay skips (`exempt[i]`), as HF Trainer skips biases and norm
    /// weights ([`hf_trainer_no_decay`]); by default every parameter decays.
    fn exempt_from_weight_decay(&mut self, exempt: Vec<bool>) {
        self.rules().exempt = exempt;
    }

    /// [`Optimizer::update`] without a gradient factor or model weights.
    fn step(&mut self, params: &[Var], grads: &[Option<Tensor>], lr: f64) -> Result<()> {
        self.update(params, grads, lr, 1.0, None)
    }

    /// [`Optimizer::update`] of fp32 masters `params`, written into `model`.
    fn step_into(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        model: &[Var],
    ) -> Result<()> {
        self.update(params, grads, lr, 1.0, Some(model))
    }
}
