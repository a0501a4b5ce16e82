//! The training framework the three binaries share: their flags and config files, the memory
//! plan, the loop with its schedule, evaluation, checkpoints and exact resume, the EMA, the data
//! order, and the bench helpers.
//!
//! - [`cli`] ([`CommonArgs`]: the shared flags), [`config`] (TOML file and presets under the
//!   flags), [`binary`] (what a binary tells them).
//! - [`session`]: one way from flags to a [`Session`]; [`plan`]: model-state bytes before a run;
//!   [`fit`]: `--fit`'s search; [`fit_check`]: a run under `--fit` against its plan.
//! - [`task`] ([`Task`]: what a binary supplies), `run` (the loop), `step` (one step), `eval` (best checkpoint,
//!   early stopping), `saved` (checkpoints, resume), [`metrics`], [`settings`], [`lock`] (one
//!   run per output folder), [`ranks`] (a data-parallel run's ranks: what rank 0 alone does).
//! - [`order`]: the epoch order of every binary's data; [`schedule`]: learning rates; [`ema`].
//! - [`repo`]: a model folder or Hub id; [`bench`]: what the bench commands share.

pub mod bench;
pub mod binary;
pub mod cli;
pub mod config;
pub mod ema;
pub mod eval;
pub mod fit;
pub mod fit_check;
pub mod lock;
pub mod metrics;
pub mod order;
pub mod plan;
pub mod ranks;
pub mod repo;
mod run;
mod saved;
pub mod schedule;
pub mod session;
pub mod settings;
mod step;
mod step_ranks;
pub mod task;

pub use binary::{parse_args, parse_args_from, Binary};
pub use cli::CommonArgs;
pub use eval::BestState;
pub use lock::FolderLock;
pub use metrics::logged;
pub use order::{EpochCursor, EpochOrder, Epochs, Grouping};
pub use repo::ModelRepo;
pub use run::run;
pub use saved::{save_checkpoint, Progress, Split};
pub use session::{LoopPlan, Session, SessionBuilder};
pub use settings::{BestConfig, LoopConfig, RunSummary};
pub use task::{StepCtx, Task, TaskResult, Units};
