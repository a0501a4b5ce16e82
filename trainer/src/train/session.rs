//! A trainer ready to run, and the one way the three binaries build it from their flags.
//!
//! Every binary's setup is the same walk with its own model and data in the middle:
//! [`SessionBuilder::new`] (device, precision, the ledger with its timeline), the weights a run
//! starts from ([`SessionBuilder::resumed_weights`], else the binary's model) loaded once through
//! [`SessionBuilder::params`], [`SessionBuilder::loaded`], the optimizer after the plan is shown
//! ([`SessionBuilder::optimizer`]), and the loop settings ([`SessionBuilder::session`]).

use std::sync::Arc;

use candle_core::Device;
use ft_params::checkpoint::Checkpointer;
use ft_params::weights::SafetensorsFiles;
use ft_params::{ParamBuilder, ParamStore};

use super::cli::CommonArgs;
use super::lock::FolderLock;
use super::plan::StatePlan;
use super::ranks;
use super::repo::ModelRepo;
use super::settings::{BestConfig, LoopConfig, RunSummary};
use super::task::{Task, Units};
use crate::error::{Error, Result};
use crate::ledger::Ledger;
use crate::update::{MixedOptimizer, Precision};

/// A trainer ready to run: what each binary's setup builds from its arguments.
pub struct Session<T: Task> {
    pub task: T,
    pub optimizer: MixedOptimizer,
    pub ledger: Ledger,
    pub loop_config: LoopConfig,
    pub checkpointer: Checkpointer,
    /// The output folder's lock, held while the session lives (`None` for a session built by
    /// hand, as tests do).
    pub lock: Option<FolderLock>,
}

impl<T: Task> Session<T> {
    /// Runs the loop until `loop_config.max_steps` (or early stopping), then draws the memory
    /// timeline to `memory.svg` in the output folder (also when the loop failed: the picture
    /// of a run that ran out of memory is the one a user needs most).
    pub fn train(&mut self) -> Result<RunSummary> {
        let result = super::run::run(
            &mut self.task,
            &mut self.optimizer,
            &self.checkpointer,
            &mut self.ledger,
            &self.loop_config,
        );
        let dir = &self.loop_config.output_dir;
        // Rank 0 draws its own timeline; the others keep none.
        if !ranks::is_main()? {
            return result;
        }
        let title = format!(
            "memory above the baseline, {} ({})",
            dir.display(),
            if self.ledger.is_measured() {
                "measured"
            } else {
                "told bytes only: not measured"
            }
        );
        let chart =
            self.ledger
                .write_chart(&dir.join("memory.svg"), &title, self.loop_config.budget);
        let summary = result?;
        chart?;
        Ok(summary)
    }
}

/// How a binary's data and evaluation shape the loop.
#[derive(Debug, Clone)]
pub struct LoopPlan {
    /// What the loss is averaged over.
    pub units: Units,
    /// Micro-batches in one pass over the training data (for `--epochs`).
    pub micro_batches_per_epoch: usize,
    /// Evaluation and save intervals when `--eval-every` / `--save-every` are not given.
    pub eval_every: u64,
    pub save_every: u64,
    /// Keep the best checkpoint by this metric (and stop early).
    pub best: Option<BestConfig>,
}

impl LoopPlan {
    /// Loss over `units`, `micro_batches_per_epoch` micro-batches an epoch, evaluation and saves
    /// at the end unless the flags say otherwise, no best-checkpoint tracking.
    pub fn new(units: Units, micro_batches_per_epoch: usize) -> Self {
        LoopPlan {
            units,
            micro_batches_per_epoch,
            eval_every: 0,
            save_every: 0,
            best: None,
        }
    }
}

/// Builds a [`Session`] from the shared flags.
pub struct SessionBuilder {
    common: CommonArgs,
    device: Device,
    precision: Precision,
    ledger: Ledger,
    store: Arc<ParamStore>,
    /// The files the weights were read from, for errors.
    source: Option<String>,
    /// Rank 0's (see [`ranks::lock_output`]).
    lock: Option<FolderLock>,
}

impl SessionBuilder {
    /// Takes the output folder for this run (one run at a time: [`FolderLock`], rank 0's in a
    /// data-parallel run), opens `--device`, picks the precision and starts the ledger (its
    /// timeline in `memory.jsonl` there, rank 0's) at its baseline.
    pub fn new(common: &CommonArgs) -> Result<Self> {
        Self::with_lock(common, ranks::lock_output(&common.output_dir)?)
    }

    /// [`SessionBuilder::new`] with the output folder's lock already taken: a binary that writes
    /// into the folder before the session starts (a demo's files) takes the lock first, so a
    /// second run never rewrites files the first is reading.
    pub fn with_lock(common: &CommonArgs, lock: Option<FolderLock>) -> Result<Self> {
        let out = &common.output_dir;
        let device = common.device()?;
        let precision = common.precision(&device)?;
        let mut ledger = Ledger::new(&device);
        if ranks::is_main()? {
            ledger = ledger.with_timeline(out.join("memory.jsonl"))?;
        }
        ledger.set_baseline();
        Ok(SessionBuilder {
            common: common.clone(),
            device,
            precision,
            ledger,
            store: ParamStore::new(),
            source: None,
            lock,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The ledger, for what a binary measures before the model exists (its cache build).
    pub fn ledger(&mut self) -> &mut Ledger {
        &mut self.ledger
    }

    /// The store the model's parameters go into.
    pub fn store(&self) -> &Arc<ParamStore> {
        &self.store
    }

    /// With `--resume`, the weights file `stem` (`model`, `unet/diffusion_pytorch_model`) of
    /// the checkpoint folder: a resumed run starts from the weights it saved. `None` otherwise.
    pub fn resumed_weights(&self, stem: &str) -> Result<Option<SafetensorsFiles>> {
        match &self.common.resume {
            Some(dir) => Ok(Some(ModelRepo::Local(dir.clone()).safetensors(stem)?)),
            None => Ok(None),
        }
    }

    /// The builder the model creates its parameters with: in the training dtype on the device,
    /// read from `weights` once, or initialised from `--seed` without them.
    pub fn params(&mut self, weights: Option<SafetensorsFiles>) -> ParamBuilder {
        self.source = weights.as_ref().map(|w| {
            let paths: Vec<String> = w.paths().iter().map(|p| p.display().to_string()).collect();
            paths.join(", ")
        });
        let pb = ParamBuilder::new(
            self.store.clone(),
            self.precision.storage,
            &self.device,
            self.common.seed,
        );
        match weights {
            Some(files) => pb.with_source(Arc::new(files)),
            None => pb,
        }
    }

    /// Marks the model loaded (the ledger's `load` point), after checking that no weight holds
    /// inf or NaN: such a model would train to NaN at once, or worse, quietly.
    pub fn loaded(&mut self) -> Result<()> {
        let all = self.store.all();
        // Every rank must hold the same model (names, shapes, dtypes) before the first step.
        let shapes: String = all
            .iter()
            .map(|(n, t)| format!("{n} {:?} {:?}\n", t.dims(), t.dtype()))
            .collect();
        ranks::world()?.agree("the model's parameters", shapes.as_bytes())?;
        let named = all.iter().map(|(n, t)| (n.as_str(), t));
        if let Some(name) = crate::update::first_non_finite(named)? {
            return Err(Error::Invalid(format!(
                "the model's weight `{name}` holds inf or NaN{}: it cannot be trained from",
                match &self.source {
                    Some(files) => format!(" (read from {files})"),
                    None => String::new(),
                }
            )));
        }
        self.ledger.mark("load", 0)?;
        Ok(())
    }

    /// Shows `plan` (the model states this run will hold), then builds the `--optim`
    /// optimizer over the store's trainable parameters.
    pub fn optimizer(&mut self, plan: &StatePlan) -> Result<MixedOptimizer> {
        ranks::say(plan.report());
        self.ledger.set_predicted_peak(plan.device_bytes());
        self.common
            .optimizer(self.store.trainable()?, self.precision)
    }

    /// The session: `task` trained by `optimizer` on the loop `plan` describes, in the
    /// [`crate::update::StepMode`] the flags ask for.
    pub fn session<T: Task>(
        self,
        task: T,
        optimizer: MixedOptimizer,
        plan: LoopPlan,
    ) -> Result<Session<T>> {
        let c = &self.common;
        let max_steps = c.max_steps(plan.micro_batches_per_epoch);
        let loop_config = LoopConfig {
            units: plan.units,
            mode: c.step_mode()?,
            max_steps,
            schedule: c.schedule(max_steps)?,
            seed: c.seed,
            output_dir: c.output_dir.clone(),
            eval_every: c.eval_every.unwrap_or(plan.eval_every),
            save_every: c.save_every.unwrap_or(plan.save_every),
            progress: !c.quiet,
            resume: c.resume.clone(),
            best: plan.best,
            max_bad_steps: c.max_bad_steps,
            budget: c.fit_budget()?,
            batch_size: c.batch_size,
        };
        Ok(Session {
            task,
            optimizer,
            ledger: self.ledger,
            loop_config,
            checkpointer: Checkpointer::with_strategy(c.checkpoint_strategy()?),
            lock: self.lock,
        })
    }
}
