//! The training loop the three binaries share: micro-batches, loss normalisation over the whole
//! step, checkpointed backward, accumulation, the mixed-precision step, evaluation and checkpoint
//! schedule, progress bar, metrics JSONL, the ledger's profile points, and exact resume.
//!
//! A trainer supplies a [`Task`] (its data and model); the loop supplies everything else, once.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Tensor, Var};

use crate::accumulate::{GradAccumulator, LossNorm};
use crate::checkpoint::Checkpointer;
use crate::error::{Error, Result};
use crate::ledger::{format_bytes, Category, Ledger};
use crate::mixed::MixedOptimizer;
use crate::schedule::LrSchedule;

/// Result of a task method; binaries can use anyhow errors (they convert with `?` + `.into()`).
pub type TaskResult<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// What the loop passes to a forward pass.
pub struct StepCtx<'a> {
    /// Optimizer steps done before this one.
    pub step: u64,
    /// Index of the micro-batch within the step.
    pub micro: usize,
    /// Seed of this micro-batch's dropout masks: a function of (run seed, step, micro) only, so a
    /// resumed run draws the masks an uninterrupted one would have.
    pub dropout_seed: u64,
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
    /// Loss units in a batch (label tokens for seq2seq, samples for images) and samples in it.
    fn counts(&self, batch: &Self::Batch) -> (usize, usize);
    /// The batch's loss *summed* over its units (the loop divides by the step's total units).
    fn summed_loss(&mut self, batch: &Self::Batch, ctx: &StepCtx) -> TaskResult<Tensor>;
    /// Called after each optimizer step with the updated weights (the fp32 masters when the
    /// model is stored in low precision): an EMA folds them in here. `step` counts steps done.
    fn after_step(&mut self, _step: u64, _weights: &[Var], _ledger: &mut Ledger) -> TaskResult<()> {
        Ok(())
    }
    /// Evaluation metrics at `step` (the ledger gets `eval/...` points from the loop around it).
    fn evaluate(&mut self, step: u64, ledger: &mut Ledger) -> TaskResult<Vec<(String, f64)>>;
    /// Writes the model in its Hugging Face layout into `dir`.
    fn save_model(&self, dir: &Path) -> TaskResult<()>;
    /// Position in the data (epoch, order, cursor) for resume.
    fn data_state(&self) -> serde_json::Value;
    fn restore_data_state(&mut self, state: &serde_json::Value) -> TaskResult<()>;
}

/// Loop settings.
#[derive(Debug, Clone)]
pub struct LoopConfig {
    pub units: Units,
    pub accum: usize,
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
    /// Update each checkpointed segment's parameters during the backward
    /// (`MixedOptimizer::backward_and_step`); needs `accum == 1`.
    pub fused_backward: bool,
}

/// "Best checkpoint kept, early stopping": which metric decides and how long to wait.
#[derive(Debug, Clone)]
pub struct BestConfig {
    /// Key of a metric returned by [`Task::evaluate`].
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

fn task_err(e: Box<dyn std::error::Error + Send + Sync>) -> Error {
    Error::Task(e)
}

/// The values `key` took in a run's `metrics.jsonl` (`output_dir/metrics.jsonl`), in order,
/// from the lines that have it: a run's curve (`loss`), or `updated_in_backward`.
pub fn logged(path: &std::path::Path, key: &str) -> Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get(key).filter(|x| !x.is_null()).cloned())
        .collect())
}

struct Metrics {
    path: PathBuf,
    file: std::fs::File,
}

impl Metrics {
    fn open(path: PathBuf, append: bool) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(append)
            .write(true)
            .truncate(!append)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        Ok(Metrics { path, file })
    }

    fn write(&mut self, v: serde_json::Value) -> Result<()> {
        writeln!(self.file, "{v}").map_err(|e| Error::io(&self.path, e))
    }
}

fn mix(seed: u64, step: u64, micro: usize) -> u64 {
    let mut r =
        crate::rng::SplitMix64::new(seed ^ step.wrapping_mul(0x9E37_79B9) ^ ((micro as u64) << 48));
    r.next_u64()
}

/// A trainer ready to run: what each binary's setup builds from its arguments.
pub struct Session<T: Task> {
    pub task: T,
    pub optimizer: MixedOptimizer,
    pub ledger: Ledger,
    pub loop_config: LoopConfig,
    pub checkpointer: Checkpointer,
}

impl<T: Task> Session<T> {
    /// Runs the loop until `loop_config.max_steps` (or early stopping).
    pub fn train(&mut self) -> Result<RunSummary> {
        run(
            &mut self.task,
            &mut self.optimizer,
            &self.checkpointer,
            &mut self.ledger,
            &self.loop_config,
        )
    }
}

/// Where an epoch-based task is in its data: the epoch and the next item's index. What most
/// tasks return from [`Task::data_state`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EpochCursor {
    pub epoch: usize,
    pub cursor: usize,
}

impl EpochCursor {
    pub fn to_json(self) -> serde_json::Value {
        serde_json::json!({"epoch": self.epoch, "cursor": self.cursor})
    }

    /// Reads what [`EpochCursor::to_json`] wrote; names the missing field.
    pub fn from_json(v: &serde_json::Value) -> TaskResult<Self> {
        let field = |k: &str| -> TaskResult<usize> {
            Ok(v[k]
                .as_u64()
                .ok_or_else(|| format!("trainer_state: data.{k} missing"))? as usize)
        };
        Ok(EpochCursor {
            epoch: field("epoch")?,
            cursor: field("cursor")?,
        })
    }
}

/// Runs the loop over `task` with `opt` until `cfg.max_steps`.
pub fn run<T: Task>(
    task: &mut T,
    opt: &mut MixedOptimizer,
    checkpointer: &Checkpointer,
    ledger: &mut Ledger,
    cfg: &LoopConfig,
) -> Result<RunSummary> {
    std::fs::create_dir_all(&cfg.output_dir).map_err(|e| Error::io(&cfg.output_dir, e))?;
    let params: Vec<Var> = opt.params().to_vec();
    let mut step = 0u64;
    let mut epoch = 0usize;
    if let Some(dir) = &cfg.resume {
        let st = load_checkpoint_state(dir, opt)?;
        step = st.step;
        epoch = st.epoch;
        task.restore_data_state(&st.data).map_err(task_err)?;
    } else {
        task.start_epoch(epoch).map_err(task_err)?;
    }
    let mut metrics = Metrics::open(cfg.output_dir.join("metrics.jsonl"), cfg.resume.is_some())?;
    opt.account(ledger, "model");
    ledger.mark("load", step)?;

    let bar = if cfg.progress {
        let b = indicatif::ProgressBar::new(cfg.max_steps);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] step {pos}/{len} {msg} eta {eta}",
        ) {
            b.set_style(style.progress_chars("=> "));
        }
        b.set_position(step);
        b
    } else {
        indicatif::ProgressBar::hidden()
    };

    if cfg.fused_backward && (cfg.accum != 1 || !checkpointer.enabled()) {
        return Err(Error::Invalid(
            "a fused backward pass needs one micro-batch a step and gradient checkpointing (this \
             trainer's model has no checkpointed segments, or --accum is above 1)"
                .into(),
        ));
    }
    let mut summary = RunSummary::default();
    let mut acc = GradAccumulator::on(&opt.state_device());
    let mut bad_evals = 0usize;
    while step < cfg.max_steps {
        let t0 = Instant::now();
        // Gather the step's micro-batches first: the loss is normalised by all of their units.
        let mut batches = Vec::with_capacity(cfg.accum);
        let mut fresh_epochs = 0;
        while batches.len() < cfg.accum {
            match task.next_batch().map_err(task_err)? {
                Some(b) => batches.push(b),
                None => {
                    if !batches.is_empty() {
                        break; // a short last step of the epoch, like a DataLoader's last batch
                    }
                    fresh_epochs += 1;
                    if fresh_epochs > 1 {
                        return Err(Error::Invalid("the training data yields no batch".into()));
                    }
                    epoch += 1;
                    task.start_epoch(epoch).map_err(task_err)?;
                }
            }
        }
        let counts: Vec<(usize, usize)> = batches.iter().map(|b| task.counts(b)).collect();
        let units: Vec<usize> = counts.iter().map(|c| c.0).collect();
        let samples: usize = counts.iter().map(|c| c.1).sum();
        let norm = match cfg.units {
            Units::Tokens => LossNorm::tokens(&units),
            Units::Samples => LossNorm::samples(&units),
        };
        let mut step_loss = 0f64;
        let mut updated_in_backward = 0usize;
        for (micro, batch) in batches.iter().enumerate() {
            let ctx = StepCtx {
                step,
                micro,
                dropout_seed: mix(cfg.seed, step, micro),
                checkpointer,
            };
            checkpointer.begin_forward();
            let summed = task.summed_loss(batch, &ctx).map_err(task_err)?;
            let loss = norm.scale(&summed)?;
            step_loss += loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            let scaled = if opt.loss_scale() != 1.0 {
                (loss * opt.loss_scale())?
            } else {
                loss
            };
            ledger.mark("forward", step)?;
            if cfg.fused_backward {
                // Backward and update together: no gradients of the whole model at once.
                updated_in_backward +=
                    opt.backward_and_step(checkpointer, &scaled, cfg.schedule.lr_at(step))?;
                ledger.mark("backward", step)?;
                continue;
            }
            let grads = checkpointer.gradients(&scaled, &params)?;
            drop(scaled);
            acc.add(grads)?;
            ledger.set_on(Category::Gradients, "model", acc.bytes(), acc.device());
            ledger.mark("backward", step)?;
        }
        drop(batches);
        let lr = cfg.schedule.lr_at(step);
        let outcome = if cfg.fused_backward {
            crate::mixed::StepOutcome {
                applied: true,
                grad_norm: None,
            }
        } else {
            opt.step(acc.take(), lr)?
        };
        ledger.remove(Category::Gradients, "model");
        opt.account(ledger, "model");
        step += 1;
        let weights = if opt.masters().is_empty() {
            opt.params()
        } else {
            opt.masters()
        };
        task.after_step(step, weights, ledger).map_err(task_err)?;
        ledger.mark("step", step)?;
        summary.losses.push(step_loss);
        let secs = t0.elapsed().as_secs_f64();
        let live = crate::measure::read_live(opt.params().first().map(|p| p.device()));
        metrics.write(serde_json::json!({
            "step": step, "epoch": epoch, "loss": step_loss, "lr": lr,
            "grad_norm": outcome.grad_norm, "skipped": !outcome.applied,
            "samples_per_s": samples as f64 / secs.max(1e-9), "step_time_s": secs,
            "memory_bytes": live,
            "updated_in_backward": cfg.fused_backward.then_some(updated_in_backward),
        }))?;
        bar.set_message(format!(
            "loss {step_loss:.4} {:.1} samples/s mem {}",
            samples as f64 / secs.max(1e-9),
            format_bytes(live as i64)
        ));
        bar.set_position(step);

        let last = step == cfg.max_steps;
        if (cfg.eval_every > 0 && step.is_multiple_of(cfg.eval_every)) || last {
            ledger.mark("eval/before", step)?;
            let m = task.evaluate(step, ledger).map_err(task_err)?;
            ledger.mark("eval/after", step)?;
            let mut line = serde_json::Map::new();
            line.insert("step".into(), step.into());
            for (k, v) in &m {
                line.insert(format!("eval_{k}"), serde_json::json!(v));
            }
            metrics.write(serde_json::Value::Object(line))?;
            if !m.is_empty() {
                bar.println(format!(
                    "step {step}: {}",
                    m.iter()
                        .map(|(k, v)| format!("{k} {v:.4}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            let mut stop = false;
            if let Some(b) = &cfg.best {
                if let Some((_, v)) = m.iter().find(|(k, _)| *k == b.metric) {
                    let better = match &summary.best {
                        None => true,
                        Some((best, _)) => {
                            if b.higher_is_better {
                                v > best
                            } else {
                                v < best
                            }
                        }
                    };
                    if better {
                        let dir = cfg.output_dir.join("best");
                        save_checkpoint(task, opt, step, epoch, &dir)?;
                        summary.best = Some((*v, dir));
                        bad_evals = 0;
                    } else {
                        bad_evals += 1;
                        stop = b.patience > 0 && bad_evals >= b.patience;
                    }
                }
            }
            summary.last_eval = m;
            if stop && !last {
                bar.println(format!(
                    "early stopping at step {step}: no improvement in {bad_evals} evaluations"
                ));
                let dir = cfg.output_dir.join(format!("checkpoint-{step}"));
                save_checkpoint(task, opt, step, epoch, &dir)?;
                summary.final_dir = Some(dir);
                summary.stopped_early = true;
                break;
            }
        }
        if (cfg.save_every > 0 && step.is_multiple_of(cfg.save_every)) || last {
            let dir = cfg.output_dir.join(format!("checkpoint-{step}"));
            save_checkpoint(task, opt, step, epoch, &dir)?;
            summary.final_dir = Some(dir);
        }
    }
    bar.finish();
    summary.steps = step;
    Ok(summary)
}

/// What `trainer_state.json` holds.
struct TrainerState {
    step: u64,
    epoch: usize,
    data: serde_json::Value,
}

/// Writes model files, `optimizer.safetensors` and `trainer_state.json` into `dir`, atomically
/// as a whole: everything goes to `dir.tmp` first, which is renamed over `dir` at the end.
pub fn save_checkpoint<T: Task>(
    task: &T,
    opt: &MixedOptimizer,
    step: u64,
    epoch: usize,
    dir: &Path,
) -> Result<()> {
    let tmp = dir.with_extension("tmp");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    task.save_model(&tmp).map_err(task_err)?;
    let (opt_step, loss_scale, tensors) = opt.state();
    crate::fsutil::save_safetensors(&tensors, &tmp.join("optimizer.safetensors"))?;
    let state = serde_json::json!({
        "global_step": step,
        "epoch": epoch,
        "optimizer_step": opt_step,
        "loss_scale": loss_scale,
        "data": task.data_state(),
    });
    crate::fsutil::write_atomic(&tmp.join("trainer_state.json"), |f| {
        f.write_all(
            serde_json::to_string_pretty(&state)
                .unwrap_or_default()
                .as_bytes(),
        )
    })?;
    if dir.exists() {
        let old = dir.with_extension("old");
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
        std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
    }
    Ok(())
}

fn load_checkpoint_state(dir: &Path, opt: &mut MixedOptimizer) -> Result<TrainerState> {
    let path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let field = |k: &str| {
        v.get(k).ok_or_else(|| Error::Json {
            path: path.clone(),
            reason: format!("missing `{k}`"),
        })
    };
    let step = field("global_step")?.as_u64().unwrap_or(0);
    let epoch = field("epoch")?.as_u64().unwrap_or(0) as usize;
    let opt_step = field("optimizer_step")?.as_u64().unwrap_or(0);
    let loss_scale = field("loss_scale")?.as_f64().unwrap_or(1.0);
    let data = field("data")?.clone();
    let opt_path = dir.join("optimizer.safetensors");
    // Where the optimizer keeps its state: the model's device, or the host when offloaded.
    let device = opt.state_device();
    let files = crate::weights::SafetensorsFiles::open(std::slice::from_ref(&opt_path))?;
    // One tensor at a time: the optimizer keeps a copy of each moment, so the file's tensor is
    // freed before the next is read (all of them at once would hold a second set of moments and
    // masters, gigabytes on a large model).
    opt.load_state(opt_step, loss_scale, &[])?;
    let names: Vec<String> = files.names().map(|s| s.to_string()).collect();
    for name in names {
        // 8-bit moments stay bytes; everything else is fp32 state.
        let dtype = match files.meta(&name).map(|m| m.dtype) {
            Some(safetensors::Dtype::U8) => candle_core::DType::U8,
            _ => candle_core::DType::F32,
        };
        let t = files.load(&name, None, dtype, &device, false)?;
        opt.load_state(opt_step, loss_scale, &[(name, t)])?;
    }
    Ok(TrainerState { step, epoch, data })
}

/// Alone in the library's unit-test binary, so the counting allocator sees only this test.
#[cfg(test)]
mod resume_memory {
    use candle_core::{DType, Device, Tensor, Var};

    use super::load_checkpoint_state;
    use crate::alloc::{measure_peak, CountingAlloc};
    use crate::mixed::{MixedOptimizer, StatePlacement};
    use crate::optim::AdamWConfig;
    use crate::precision::Precision;

    #[global_allocator]
    static ALLOC: CountingAlloc = CountingAlloc;

    const PARAMS: usize = 8;
    const ELEMS: usize = 2 << 20;

    fn optimizer() -> anyhow::Result<MixedOptimizer> {
        let params = (0..PARAMS)
            .map(|i| {
                let t = Tensor::ones(ELEMS, DType::BF16, &Device::Cpu)?;
                Ok((format!("p{i}"), Var::from_tensor(&t)?))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(MixedOptimizer::adamw(
            params,
            Precision::parse("bf16")?,
            StatePlacement::WithModel,
            AdamWConfig::default(),
            None,
        )?)
    }

    /// Resuming reads `optimizer.safetensors` one tensor at a time: the peak above the fresh
    /// optimizer is the restored moments plus about one tensor, not the file's whole contents
    /// (moments and masters) held next to the optimizer's copies of the moments. The restored
    /// state is the saved one.
    #[test]
    fn resume_holds_about_one_file_tensor_beyond_the_restored_state() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("ft-resume-memory-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let saved = {
            let mut a = optimizer()?;
            let grads = (0..PARAMS)
                .map(|i| Ok(Some(Tensor::full(0.1 * i as f32, ELEMS, &Device::Cpu)?)))
                .collect::<anyhow::Result<Vec<_>>>()?;
            a.step(grads, 1e-3)?;
            let (step, scale, tensors) = a.state();
            crate::fsutil::save_safetensors(&tensors, &dir.join("optimizer.safetensors"))?;
            let state = serde_json::json!({"global_step": 1, "epoch": 0, "optimizer_step": step,
                                           "loss_scale": scale, "data": null});
            std::fs::write(dir.join("trainer_state.json"), state.to_string())?;
            tensors[1].1.to_vec1::<f32>()?
        };
        let mut b = optimizer()?;
        let tensor = ELEMS * 4;
        let (restored, peak) = measure_peak(|| load_checkpoint_state(&dir, &mut b));
        let restored = restored?;
        std::fs::remove_dir_all(&dir)?;
        assert_eq!(restored.step, 1);
        let (step, _, state) = b.state();
        assert_eq!(step, 1);
        assert_eq!(state[1].1.to_vec1::<f32>()?, saved);
        // Moments restored: 2 per parameter. The file also holds a master per parameter.
        let moments = 2 * PARAMS * tensor;
        eprintln!(
            "resume peak {} MiB: restored moments {} MiB, file {} MiB",
            peak >> 20,
            moments >> 20,
            (3 * PARAMS * tensor) >> 20
        );
        assert!(peak >= moments, "peak {peak} below the restored moments");
        assert!(
            peak <= moments + 3 * tensor,
            "resume peaked at {} MiB for {} MiB of restored moments (the file holds {} MiB)",
            peak >> 20,
            moments >> 20,
            (3 * PARAMS * tensor) >> 20
        );
        Ok(())
    }
}
