//! Command line plus config file, shared by the binaries: `--config FILE` gives defaults, flags
//! typed on the command line override the file, and built-in defaults fill the rest.
//!
//! A binary declares one struct that derives `clap::Parser`, `Serialize` and `Deserialize` (field
//! names are the TOML keys and the `--long-flags`). [`parse`] merges the three layers and reports a
//! config file's unknown key or wrong type with the file's name.

use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::Parser;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};

/// Parses the process's arguments; `config_path` picks the `--config` field out of the parsed CLI.
pub fn parse<T>(config_path: impl Fn(&T) -> Option<PathBuf>) -> Result<T>
where
    T: Parser + Serialize + DeserializeOwned,
{
    parse_from(std::env::args_os(), config_path)
}

/// [`parse_from`] with a built-in TOML preset between the flags' defaults and the config file:
/// built-in defaults < preset (a binary's own defaults, or its `--demo` settings) < `--config`
/// file < flags typed on the command line.
pub fn parse_with_preset<T, I, A>(
    args: I,
    config_path: impl Fn(&T) -> Option<PathBuf>,
    preset: impl Fn(&T) -> Option<(&'static str, &'static str)>,
) -> Result<T>
where
    T: Parser + Serialize + DeserializeOwned,
    I: IntoIterator<Item = A>,
    A: Into<std::ffi::OsString> + Clone,
{
    let matches = T::command().get_matches_from(args);
    let parsed = T::from_arg_matches(&matches).map_err(|e| Error::Invalid(e.to_string()))?;
    let explicit: Vec<String> = matches
        .ids()
        .filter(|id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| id.as_str().to_string())
        .collect();
    let known: Vec<String> = T::command()
        .get_arguments()
        .map(|a| a.get_id().as_str().to_string())
        .collect();
    let with_preset = match preset(&parsed) {
        Some((label, text)) => merge_text(&parsed, text, label, &known, &explicit)?,
        None => parsed,
    };
    match config_path(&with_preset) {
        Some(path) => merge_file(&with_preset, &path, &known, &explicit),
        None => Ok(with_preset),
    }
}

/// [`parse`] over explicit arguments (the first is the program name). `--help` and bad flags exit
/// through clap as usual.
pub fn parse_from<T, I, A>(args: I, config_path: impl Fn(&T) -> Option<PathBuf>) -> Result<T>
where
    T: Parser + Serialize + DeserializeOwned,
    I: IntoIterator<Item = A>,
    A: Into<std::ffi::OsString> + Clone,
{
    parse_with_preset(args, config_path, |_: &T| None)
}

/// `parsed` (CLI values with built-in defaults) overlaid with the file's values, except those given
/// explicitly on the command line.
pub fn merge_file<T>(parsed: &T, path: &Path, known: &[String], explicit: &[String]) -> Result<T>
where
    T: Serialize + DeserializeOwned,
{
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    merge_text(parsed, &text, &path.display().to_string(), known, explicit)
}

/// [`merge_file`] over TOML text; `label` names it in errors.
pub fn merge_text<T>(
    parsed: &T,
    text: &str,
    label: &str,
    known: &[String],
    explicit: &[String],
) -> Result<T>
where
    T: Serialize + DeserializeOwned,
{
    let cfg_err = |reason: String| Error::Config {
        path: label.to_string(),
        reason,
    };
    let file: toml::Table = toml::from_str(text).map_err(|e| cfg_err(e.to_string()))?;
    let mut merged =
        toml::Table::try_from(parsed).map_err(|e| cfg_err(format!("internal: {e}")))?;
    for (key, value) in file {
        let key = key.replace('-', "_");
        if key == "config" || !known.contains(&key) {
            let mut valid: Vec<&str> = known
                .iter()
                .map(|s| s.as_str())
                .filter(|k| *k != "config" && *k != "help" && *k != "version")
                .collect();
            valid.sort();
            return Err(cfg_err(format!(
                "unknown key `{key}` (valid keys: {})",
                valid.join(", ")
            )));
        }
        if !explicit.contains(&key) {
            merged.insert(key, value);
        }
    }
    toml::Value::Table(merged)
        .try_into()
        .map_err(|e: toml::de::Error| cfg_err(e.to_string()))
}

/// The optimizers `--optim` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimKind {
    /// AdamW with fp32 moments.
    AdamW,
    /// AdamW with blockwise 8-bit moments (`crate::adamw8bit`).
    AdamW8bit,
    /// Adafactor with HF Trainer's settings (`crate::adafactor`): factored second moments.
    Adafactor,
}

/// Settings every trainer shares (flattened into each binary's arguments and config file).
#[derive(clap::Args, Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
pub struct CommonArgs {
    /// Folder for checkpoints, samples, metrics.jsonl and memory.jsonl.
    #[arg(long, default_value = "runs/latest")]
    pub output_dir: PathBuf,
    /// Weights precision: f32, bf16 (fp32 master weights) or f16 (also dynamic loss scaling).
    /// Default: bf16 on GPU, f32 on CPU.
    #[arg(long)]
    pub precision: Option<String>,
    /// Micro-batch size.
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Micro-batches (episodes, for fewshot-ft) per optimizer step: gradient accumulation.
    #[arg(
        long,
        visible_alias = "gradient-accumulation-steps",
        default_value_t = 1
    )]
    pub accum: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-4)]
    pub lr: f64,
    /// Decoupled weight decay (AdamW's and Adafactor's). t5-ft exempts biases and layer norms,
    /// as HF Trainer does; sdxl-ft and fewshot-ft decay every tensor, as diffusers' training
    /// scripts and the FSCT code do.
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    /// Learning-rate schedule after warmup: constant, linear or cosine.
    #[arg(long, default_value = "constant")]
    pub schedule: String,
    /// Optimizer steps of linear warmup from 0.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,
    /// Stop after this many optimizer steps (overrides epochs when set).
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Passes over the training data.
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Clip gradients to this global L2 norm (0 disables).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Recompute activations in backward instead of storing them.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Optimizer: adamw (fp32 moments), adamw8bit (bitsandbytes-style blockwise 8-bit
    /// moments, about 2 bytes per parameter instead of 8; on a GPU updated by a CUDA kernel
    /// beside the model, with --offload-optimizer on the host) or adafactor (transformers'
    /// Adafactor as HF Trainer builds it: factored second moments, no first moment).
    #[arg(long, default_value = "adamw")]
    pub optim: String,
    /// Keep the fp32 master weights, the AdamW moments and the accumulated gradients in host
    /// memory (DeepSpeed's ZeRO-Offload of the optimizer): the GPU holds only the weights, one
    /// micro-batch's gradients and the activations; the step runs on the CPU.
    #[arg(long)]
    pub offload_optimizer: bool,
    /// bf16 weights without fp32 master copies (kohya's --full_bf16): 4 bytes per parameter
    /// less; every updated weight is rounded stochastically so that small updates survive on
    /// average. Implies --precision bf16.
    #[arg(long)]
    pub full_bf16: bool,
    /// Update each checkpointed segment's parameters as soon as the backward has produced their
    /// gradients, then drop them (kohya's --fused_backward_pass): the model's gradients never
    /// exist all at once. Needs --gradient-checkpointing and --accum 1; clipping is per tensor.
    #[arg(long)]
    pub fused_backward: bool,
    /// Seed of initialisation, shuffling and dropout.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Run on this device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Resume from a checkpoint folder written by an earlier run.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Print the memory plan (model-state bytes on the GPU and in host memory, from the model's
    /// shapes; no weights loaded) and exit without training.
    #[arg(long)]
    pub plan: bool,
}

impl CommonArgs {
    /// Rejects settings no run can satisfy, naming the setting.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Invalid(what.to_string()));
        if self.batch_size == 0 {
            return bad("--batch-size must be at least 1");
        }
        if self.accum == 0 {
            return bad("--accum must be at least 1");
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("--lr must be a positive number");
        }
        if self.max_grad_norm < 0.0 {
            return bad("--max-grad-norm must be >= 0");
        }
        if let Some(p) = &self.precision {
            let parsed = crate::precision::Precision::parse(p)?;
            if self.full_bf16 && parsed.storage != candle_core::DType::BF16 {
                return bad("--full-bf16 trains bf16 weights: it cannot go with --precision other than bf16");
            }
        }
        if self.fused_backward {
            if self.accum != 1 {
                return bad(
                    "--fused-backward updates the weights during one micro-batch's backward: it \
                     cannot go with --accum above 1",
                );
            }
            if !self.gradient_checkpointing {
                return bad(
                    "--fused-backward updates parameters as checkpointed segments are \
                     recomputed: add --gradient-checkpointing",
                );
            }
            if self.planned_precision()?.loss_scaling {
                return bad("--fused-backward has no loss scaling: use bf16 or f32, not f16");
            }
        }
        if self.full_bf16 && self.offload_optimizer {
            return bad(
                "--full-bf16 keeps no fp32 master weights, and --offload-optimizer keeps them on \
                 the host: use one of the two",
            );
        }
        self.schedule.parse::<crate::schedule::ScheduleKind>()?;
        let cuda_n = |s: &str| {
            s.strip_prefix("cuda:")
                .is_some_and(|n| n.parse::<usize>().is_ok())
        };
        if !(self.device == "cpu" || self.device == "cuda" || cuda_n(&self.device)) {
            return Err(Error::Invalid(format!(
                "--device `{}`: expected cpu, cuda or cuda:N",
                self.device
            )));
        }
        match (
            self.optim_kind()?,
            self.device.as_str(),
            self.offload_optimizer,
        ) {
            // A plan is only arithmetic: it may be made for a GPU run on any machine.
            (OptimKind::AdamW8bit, d, false) if d != "cpu" && !self.plan && !cuda_kernels_on() => {
                return bad(
                    "--optim adamw8bit on a GPU needs this build's CUDA kernels (built with \
                     --features cuda, FT_CUDA_KERNELS not off), or --offload-optimizer to \
                     update the 8-bit moments on the host",
                )
            }
            _ => {}
        }
        if self.max_steps == Some(0) {
            return bad("--max-steps must be at least 1");
        }
        Ok(())
    }
}

impl CommonArgs {
    /// The `--device` as a candle device: `cpu`, `cuda` or `cuda:N`.
    pub fn device(&self) -> Result<candle_core::Device> {
        let cuda = |n: usize| {
            candle_core::Device::new_cuda(n).map_err(|e| {
                Error::Invalid(format!(
                    "--device {}: CUDA device {n} could not be opened ({e}); without the `cuda` \
                     feature or a GPU, use --device cpu",
                    self.device
                ))
            })
        };
        match self.device.as_str() {
            "cpu" => Ok(candle_core::Device::Cpu),
            "cuda" => cuda(0),
            s => match s.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                Some(n) => cuda(n),
                None => Err(Error::Invalid(format!(
                    "--device `{s}`: expected cpu, cuda or cuda:N"
                ))),
            },
        }
    }

    /// `--precision`, or bf16 with fp32 master weights on a GPU and f32 on the CPU (where some
    /// candle kernels, conv2d among them, have no bf16).
    pub fn precision(&self, device: &candle_core::Device) -> Result<crate::precision::Precision> {
        self.precision_for(device.is_cpu())
    }

    /// The precision `--device` will get, without opening the device (for `--plan`).
    pub fn planned_precision(&self) -> Result<crate::precision::Precision> {
        self.precision_for(self.device == "cpu")
    }

    fn precision_for(&self, cpu: bool) -> Result<crate::precision::Precision> {
        if self.full_bf16 {
            return Ok(crate::precision::Precision::full_bf16());
        }
        match &self.precision {
            Some(p) => crate::precision::Precision::parse(p),
            None if cpu => crate::precision::Precision::parse("f32"),
            None => crate::precision::Precision::parse("bf16"),
        }
    }

    /// Optimizer steps of the run: `--max-steps`, else `--epochs` passes of
    /// `micro_batches_per_epoch` micro-batches grouped by `--accum`.
    pub fn max_steps(&self, micro_batches_per_epoch: usize) -> u64 {
        let per_epoch = micro_batches_per_epoch.div_ceil(self.accum) as u64;
        self.max_steps
            .unwrap_or(per_epoch * self.epochs as u64)
            .max(1)
    }

    /// AdamW (`--lr` through the schedule, `--weight-decay`) over `params`, with fp32 masters as
    /// the precision asks, on the host with `--offload-optimizer`, and clipping at
    /// `--max-grad-norm` (0 disables).
    pub fn optimizer(
        &self,
        params: Vec<(String, candle_core::Var)>,
        precision: crate::precision::Precision,
    ) -> Result<crate::mixed::MixedOptimizer> {
        let clip = (self.max_grad_norm > 0.0).then_some(self.max_grad_norm);
        let cfg = crate::optim::AdamWConfig {
            weight_decay: self.weight_decay,
            ..Default::default()
        };
        let placement = crate::mixed::StatePlacement::offload(self.offload_optimizer);
        let mut opt = match self.optim_kind()? {
            OptimKind::AdamW => {
                crate::mixed::MixedOptimizer::adamw(params, precision, placement, cfg, clip)
            }
            OptimKind::AdamW8bit => crate::mixed::MixedOptimizer::new(
                params,
                precision,
                placement,
                |n| Box::new(crate::adamw8bit::AdamW8bit::new(n, cfg)),
                clip,
            ),
            OptimKind::Adafactor => crate::mixed::MixedOptimizer::new(
                params,
                precision,
                placement,
                |n| {
                    let c = crate::adafactor::AdafactorConfig::trainer(self.weight_decay);
                    Box::new(crate::adafactor::Adafactor::new(n, c))
                },
                clip,
            ),
        }?;
        // The stochastic rounding of weights without masters follows --seed, like the rest of
        // the run's randomness.
        if precision.stochastic_rounding && opt.masters().is_empty() {
            let seed = crate::rng::SplitMix64::new(self.seed ^ 0x5EED_0B16).next_u64();
            opt.optimizer_mut().set_stochastic_rounding(Some(seed));
        }
        Ok(opt)
    }

    /// The memory plan of training the trainable tensors of `store` (a loaded model, or one
    /// built from shapes only) with these flags under `precision`; `segments` are the model's
    /// checkpoint segments (each one's tensors), which bound the gradients under
    /// `--fused-backward`.
    pub fn state_plan(
        &self,
        store: &crate::weights::ParamStore,
        segments: &[Vec<candle_core::Tensor>],
        precision: crate::precision::Precision,
    ) -> Result<crate::plan::StatePlan> {
        let plan = crate::plan::state_plan(
            &store.shapes(true),
            &precision,
            crate::mixed::StatePlacement::offload(self.offload_optimizer),
            self.optim_kind()?,
            self.accum,
            self.device != "cpu",
        );
        Ok(if self.fused_backward {
            plan.under_fused_backward(store.segments(segments))
        } else {
            plan
        })
    }

    /// For `--plan`: the precision the run will use and a builder that records the model's
    /// parameter shapes into the returned store without allocating them (on the CPU, nothing
    /// opened). Build the model with it, then pass the store to [`Self::state_plan`].
    pub fn shapes_builder(
        &self,
    ) -> Result<(
        crate::weights::ParamBuilder,
        std::sync::Arc<crate::weights::ParamStore>,
        crate::precision::Precision,
    )> {
        let precision = self.planned_precision()?;
        let store = crate::weights::ParamStore::new();
        let pb = crate::weights::ParamBuilder::new(
            store.clone(),
            precision.storage,
            &candle_core::Device::Cpu,
            0,
        )
        .shapes_only();
        Ok((pb, store, precision))
    }

    /// Prints the plan to stderr before training, with a warning when host memory looks short.
    pub fn announce_plan(&self, plan: &crate::plan::StatePlan) {
        eprint!("{}", plan.report());
    }

    /// `--optim` parsed.
    pub fn optim_kind(&self) -> Result<OptimKind> {
        match self.optim.to_ascii_lowercase().as_str() {
            "adamw" | "adamw_torch" => Ok(OptimKind::AdamW),
            "adamw8bit" | "adamw_8bit" | "adamw_bnb_8bit" => Ok(OptimKind::AdamW8bit),
            "adafactor" => Ok(OptimKind::Adafactor),
            other => Err(Error::Invalid(format!(
                "--optim `{other}`: expected adamw, adamw8bit or adafactor"
            ))),
        }
    }

    /// The loop settings these flags decide (steps from `--max-steps` or `--epochs` over
    /// `micro_batches_per_epoch`, schedule, seed, output folder, `--resume`, progress unless
    /// `--quiet`); evaluation and saving only at the end and no best-checkpoint tracking:
    /// callers override those.
    pub fn loop_config(
        &self,
        units: crate::train::Units,
        micro_batches_per_epoch: usize,
    ) -> Result<crate::train::LoopConfig> {
        let max_steps = self.max_steps(micro_batches_per_epoch);
        Ok(crate::train::LoopConfig {
            units,
            accum: self.accum,
            max_steps,
            schedule: self.schedule(max_steps)?,
            seed: self.seed,
            output_dir: self.output_dir.clone(),
            eval_every: 0,
            save_every: 0,
            progress: !self.quiet,
            resume: self.resume.clone(),
            best: None,
            fused_backward: self.fused_backward,
        })
    }

    /// `--schedule` with `--lr` and `--warmup-steps` over `total_steps`.
    pub fn schedule(&self, total_steps: u64) -> Result<crate::schedule::LrSchedule> {
        Ok(crate::schedule::LrSchedule {
            kind: self.schedule.parse()?,
            base_lr: self.lr,
            warmup_steps: self.warmup_steps,
            total_steps,
        })
    }
}

/// Whether this build launches its own CUDA kernels (the 8-bit AdamW step on a GPU needs them).
fn cuda_kernels_on() -> bool {
    #[cfg(feature = "cuda")]
    {
        ft_kernels::cuda::enabled()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}
