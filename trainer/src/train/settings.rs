//! The loop's settings and what a run reports at its end.

use std::path::PathBuf;

use super::schedule::LrSchedule;
use crate::update::StepMode;

/// Loop settings.
#[derive(Debug, Clone)]
pub struct LoopConfig {
    pub units: super::Units,
    /// Micro-batches per step and whether the backward updates the weights: decided once.
    pub mode: StepMode,
    pub max_steps: u64,
    pub schedule: LrSchedule,
    pub seed: u64,
    pub output_dir: PathBuf,
    /// Evaluate every N steps (and at the end); 0 = only at the end.
    pub eval_every: u64,
    /// Save a checkpoint every N steps (and at the end); 0 = only at the end.
    pub save_every: u64,
    /// Show a progress bar (off in tests).
    pub progress: bool,
    /// Resume from this checkpoint folder.
    pub resume: Option<PathBuf>,
    /// Keep the best checkpoint by an evaluation metric in `output_dir/best`, and stop early.
    pub best: Option<BestConfig>,
    /// Stop with an error after this many steps in a row with a non-finite loss or gradient
    /// (each skipped); 0 never stops.
    pub max_bad_steps: u64,
    /// `--fit`'s budget: on the CPU, a step whose measured peak (as the plan counts it) passes
    /// it is retried in smaller parts, as a GPU's out-of-memory error is.
    pub budget: Option<u64>,
    /// The micro-batch size asked for (`--batch-size`): a checkpoint's out-of-memory split
    /// carries over to a resumed run of the same size.
    pub batch_size: usize,
}

/// "Best checkpoint kept, early stopping": which metric decides and how long to wait.
#[derive(Debug, Clone)]
pub struct BestConfig {
    /// Key of a metric returned by [`super::Task::evaluate`].
    pub metric: String,
    pub higher_is_better: bool,
    /// Stop after this many evaluations without improvement (0: never stop early).
    pub patience: usize,
}

/// What a run reports at its end.
#[derive(Debug, Clone, Default)]
pub struct RunSummary {
    pub steps: u64,
    /// Mean loss of each optimizer step, in order (resumed runs list only their own steps).
    pub losses: Vec<f64>,
    pub last_eval: Vec<(String, f64)>,
    pub final_dir: Option<PathBuf>,
    /// Best value of the watched metric and the folder holding that checkpoint.
    pub best: Option<(f64, PathBuf)>,
    /// True when early stopping ended the run before `max_steps`.
    pub stopped_early: bool,
}

impl RunSummary {
    /// What a binary prints at the end: the loss from the first step to the last, and the last
    /// evaluation's metrics.
    pub fn report(&self) -> String {
        let mut s = String::new();
        if let (Some(first), Some(last)) = (self.losses.first(), self.losses.last()) {
            s += &format!("loss {first:.4} -> {last:.4} over {} steps\n", self.steps);
        }
        for (k, v) in &self.last_eval {
            s += &format!("eval {k}: {v:.4}\n");
        }
        s
    }
}
