//! What a trainer supplies to the shared loop: a [`Task`] (its data and model) and what the loop
//! hands each forward pass.

use std::path::Path;

use candle_core::{Tensor, Var};
use ft_params::checkpoint::Checkpointer;

use crate::ledger::Ledger;

/// Result of a task method; binaries can use anyhow errors (they convert with `?` + `.into()`).
pub type TaskResult<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// What the loop passes to a forward pass.
pub struct StepCtx<'a> {
    /// Optimizer steps done before this one.
    pub step: u64,
    /// Index of the micro-batch within the step, counted over all ranks of a data-parallel
    /// run (rank `r` of `w` gets `r`, `r + w`, ...): what one process would call it.
    pub micro: usize,
    /// Seed of this micro-batch's dropout masks: a function of (run seed, step, micro) only, so a
    /// resumed run draws the masks an uninterrupted one would have.
    pub dropout_seed: u64,
    /// Position of the batch's first sample in the micro-batch `dropout_seed` was drawn for (0
    /// unless the out-of-memory retry split it): noise and masks are drawn per sample from
    /// (seed, position), so a split micro-batch draws what the whole drew.
    pub first_sample: usize,
    pub checkpointer: &'a Checkpointer,
}

/// What a loss is averaged over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Units {
    Tokens,
    Samples,
}

/// A trainer's data and model, as the loop sees them.
pub trait Task {
    type Batch;
    /// Starts epoch `epoch` (re-shuffles); called before its first `next_batch`.
    fn start_epoch(&mut self, epoch: usize) -> TaskResult<()>;
    /// The next micro-batch of the epoch, `None` at its end.
    fn next_batch(&mut self) -> TaskResult<Option<Self::Batch>>;
    /// Passes over the next micro-batch of the epoch without building it (another rank of a
    /// data-parallel run trains on it); false at the epoch's end. By default it is built and
    /// dropped.
    fn skip_batch(&mut self) -> TaskResult<bool> {
        Ok(self.next_batch()?.is_some())
    }
    /// Loss units in a batch (label tokens for seq2seq, samples for images) and samples in it.
    fn counts(&self, batch: &Self::Batch) -> (usize, usize);
    /// The batch's loss *summed* over its units (the loop divides by the step's total units).
    fn summed_loss(&mut self, batch: &Self::Batch, ctx: &StepCtx) -> TaskResult<Tensor>;
    /// The batch's first half of samples and the rest, for the out-of-memory retry: the two
    /// losses (the first half at the batch's own `first_sample`, the rest at that plus the
    /// first half's length) must sum to the whole's.
    /// `None`: it holds one sample, or cannot be split without changing the loss (batch norm
    /// over an episode).
    fn split(&self, _batch: &Self::Batch) -> TaskResult<Option<(Self::Batch, Self::Batch)>> {
        Ok(None)
    }
    /// Called after each optimizer step with the updated weights (the fp32 masters when the
    /// model is stored in low precision): an EMA folds them in here. `step` counts steps done.
    fn after_step(&mut self, _step: u64, _weights: &[Var], _ledger: &mut Ledger) -> TaskResult<()> {
        Ok(())
    }
    /// Evaluation metrics at `step` (the ledger gets `eval/...` points from the loop around it).
    fn evaluate(&mut self, step: u64, ledger: &mut Ledger) -> TaskResult<Vec<(String, f64)>>;
    /// Writes the model in its Hugging Face layout into `dir` (rank 0 of a data-parallel run).
    fn save_model(&self, dir: &Path) -> TaskResult<()>;
    /// On every rank but 0 of a data-parallel run while rank 0 runs [`Task::evaluate`]: sends
    /// what that evaluation needs from this rank (sdxl-ft: its share of the EMA). By default
    /// rank 0 needs nothing.
    fn serve_evaluation(&mut self) -> TaskResult<()> {
        Ok(())
    }
    /// On every rank but 0 while rank 0 runs [`Task::save_model`]: sends what rank 0 writes
    /// from this rank (sdxl-ft: its share of the EMA). By default nothing.
    fn serve_save(&self) -> TaskResult<()> {
        Ok(())
    }
    /// Position in the data (epoch, order, cursor) for resume.
    fn data_state(&self) -> serde_json::Value;
    fn restore_data_state(&mut self, state: &serde_json::Value) -> TaskResult<()>;
}
