//! The flags every trainer shares, declared once: flattened into each binary's arguments and
//! config file (field names are the TOML keys and the `--long-flags`). A binary declares only
//! what is its own.

use std::path::PathBuf;

use candle_core::{DType, Device};
use serde::Serialize;

use super::plan::{state_plan, StatePlan};
use super::schedule::{LrSchedule, ScheduleKind};
use crate::error::{Error, Result};
use crate::optim::registry::{self, OptimSettings, OptimSpec};
use crate::update::{MixedOptimizer, Precision, StatePlacement, StepMode, StepModeRequest};
use ft_params::checkpoint::Strategy;

/// `--fit-reserve` when not given: above the largest share by which a CPU plan fell short of
/// its run's measured peak in the `--fit` matrices (5.2%, the tiny T5 at 4 MiB;
/// docs/benchmarks.md), with room for a GPU allocator's rounding.
pub const DEFAULT_FIT_RESERVE: &str = "8%";

/// Settings every trainer shares.
#[derive(clap::Args, Serialize, serde::Deserialize, Debug, Clone, PartialEq)]
pub struct CommonArgs {
    /// TOML file with any of these settings; flags given here override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Model folder or hub id to start from (each binary's default is shown here when it has
    /// one).
    #[arg(long)]
    pub model: Option<String>,
    /// Train the bundled tiny model on bundled (generated) data; flags still override its
    /// settings.
    #[arg(long)]
    pub demo: bool,
    /// Folder for checkpoints, samples, metrics.jsonl and memory.jsonl.
    #[arg(long, default_value = "runs/latest")]
    pub output_dir: PathBuf,
    /// Evaluate every N optimizer steps, and at the end (0: only at the end). Default: only at
    /// the end; fewshot-ft validates after every epoch.
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Save a checkpoint every N optimizer steps, and at the end (0: only at the end). Default:
    /// only at the end; fewshot-ft saves after every epoch.
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Resume from a checkpoint folder written by an earlier run.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Run on this device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weights precision: f32, bf16 (fp32 master weights) or f16 (also dynamic loss scaling).
    /// Default: bf16 on GPU, f32 on CPU.
    #[arg(long)]
    pub precision: Option<String>,
    /// bf16 weights without fp32 master copies (kohya's --full_bf16): 4 bytes per parameter
    /// less; every updated weight is rounded stochastically so that small updates survive on
    /// average. Implies --precision bf16.
    #[arg(long)]
    pub full_bf16: bool,
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
    /// Optimizer: adamw (fp32 moments), adamw8bit (bitsandbytes-style blockwise 8-bit
    /// moments, about 2 bytes per parameter instead of 8; on a GPU updated by a CUDA kernel
    /// beside the model, with --offload-optimizer on the host), adafactor (transformers'
    /// Adafactor as HF Trainer builds it: factored second moments, no first moment) or sgd
    /// (torch.optim.SGD's defaults: no momentum, no state).
    #[arg(long, default_value = "adamw")]
    pub optim: String,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-4)]
    pub lr: f64,
    /// Weight decay (decoupled for AdamW and Adafactor). t5-ft exempts biases and layer norms,
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
    /// Clip gradients to this global L2 norm (0 disables); under --fused-backward each tensor
    /// to this norm of its own (kohya's rule: the model's gradients never exist at once).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Stop with an error after this many steps in a row whose loss or gradient holds inf or NaN
    /// (each one's update is skipped, and no checkpoint holds a non-finite weight); 0 never
    /// stops.
    #[arg(long, default_value_t = 3)]
    pub max_bad_steps: u64,
    /// Recompute activations in backward instead of storing them: the alias of
    /// `--checkpointing full`.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// How the model's blocks keep their activations for backward: `none` (one graph, freed
    /// when the backward returns), `blocks` (each block's graph freed as soon as its backward
    /// has run; nothing recomputed), `full` (each block recomputed in backward), `full-host`
    /// (as full, the tensors between blocks kept in host memory), `every:K`
    /// (blocks 0, K, 2K, ... recomputed, the others kept) or `budget:SIZE` (keep the blocks
    /// that fit in SIZE, e.g. budget:2GiB, the last ones first; recompute the others). Every
    /// strategy gives the same gradients. Default: none, or full with
    /// --gradient-checkpointing.
    #[arg(long)]
    pub checkpointing: Option<String>,
    /// Keep the fp32 master weights, the optimizer state and the accumulated gradients in host
    /// memory (DeepSpeed's ZeRO-Offload of the optimizer): the GPU holds only the weights, one
    /// micro-batch's gradients and the activations; the step runs on the CPU.
    #[arg(long)]
    pub offload_optimizer: bool,
    /// Update each checkpointed segment's parameters as soon as the backward has produced their
    /// gradients, then drop them (kohya's --fused_backward_pass): the model's gradients never
    /// exist all at once. Needs a --checkpointing strategy other than none (e.g.
    /// --gradient-checkpointing); works with --accum; clipping is per tensor.
    #[arg(long)]
    pub fused_backward: bool,
    /// ZeRO over the ranks of a data-parallel run (DeepSpeed's zero_optimization.stage): 0
    /// off; 1 partitions the optimizer state (each rank keeps and updates its share of the
    /// parameters, then sends the updated weights to the others); 2 also the summed gradients
    /// (each parameter's reaches only the rank that updates it; under --fused-backward, not the
    /// sums of a step's earlier micro-batches). The fp32 master weights are
    /// partitioned with the state. Checkpoints hold the whole state and resume at any number
    /// of ranks. Same updates as without.
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Seed of initialisation, shuffling and dropout.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Print the memory plan (model-state bytes on the GPU and in host memory, from the model's
    /// shapes; no weights loaded) and exit without training.
    #[arg(long)]
    pub plan: bool,
    /// With --plan: plan one rank of this many data-parallel ranks (what each GPU and its
    /// host process needs under --zero), without launching them; by default the ranks this
    /// process was launched among.
    #[arg(long)]
    pub plan_ranks: Option<usize>,
    /// Fit the run in this much memory on the training device (e.g. 24GiB, 300MiB): before
    /// training, choose the checkpointing, the optimizer state's form and place, the fused
    /// backward and the micro-batch (keeping batch size x accumulation) that the plan predicts
    /// fit, cheapest first; settings given on the command line or in --config are kept. With
    /// --plan, print the choice and its plan and stop.
    #[arg(long)]
    pub fit: Option<String>,
    /// What --fit holds back from its budget when it chooses (a share, e.g. 8%, or a size, e.g.
    /// 1GiB; 0 for none; default 8%): the plan is an estimate (on the CPU up to 5% under the
    /// measured peak), and a GPU's allocator rounds and fragments. The run itself is held to
    /// the whole budget.
    #[arg(long)]
    pub fit_reserve: Option<String>,
    /// The settings the user gave (command-line flags and --config keys), which --fit keeps.
    #[arg(skip)]
    #[serde(skip)]
    pub given: std::collections::BTreeSet<String>,
}

impl CommonArgs {
    /// Rejects settings no run can satisfy, naming the setting.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Invalid(what.to_string()));
        if self.batch_size == 0 {
            return bad("--batch-size must be at least 1");
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("--lr must be a positive number");
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return bad("--max-grad-norm must be a number >= 0 (0 disables clipping)");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("--weight-decay must be a number >= 0");
        }
        if let Some(p) = &self.precision {
            let parsed = Precision::parse(p)?;
            if self.full_bf16 && parsed.storage != DType::BF16 {
                return bad("--full-bf16 trains bf16 weights: it cannot go with --precision other than bf16");
            }
        }
        self.step_mode()?;
        if self.full_bf16 && self.offload_optimizer {
            return bad(
                "--full-bf16 keeps no fp32 master weights, and --offload-optimizer keeps them on \
                 the host: use one of the two",
            );
        }
        if self.zero > 2 {
            return bad("--zero must be 0 (off), 1 (optimizer state) or 2 (and gradients)");
        }
        if self.plan_ranks.is_some() && !self.plan {
            return bad("--plan-ranks plans a data-parallel run: it goes with --plan");
        }
        if self.plan_ranks == Some(0) {
            return bad("--plan-ranks must be at least 1");
        }
        self.schedule.parse::<ScheduleKind>()?;
        self.checkpoint_strategy()?;
        self.fit_target()?;
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
        let spec = self.optim_spec()?;
        // A plan is only arithmetic: it may be made for a GPU run on any machine.
        if spec.gpu_needs_kernels
            && self.device != "cpu"
            && !self.offload_optimizer
            && !self.plan
            && !cuda_kernels_on()
        {
            return Err(Error::Invalid(format!(
                "--optim {} on a GPU needs this build's CUDA kernels (built with --features \
                 cuda, FT_CUDA_KERNELS not off), or --offload-optimizer to update its state on \
                 the host",
                spec.name()
            )));
        }
        if self.max_steps == Some(0) {
            return bad("--max-steps must be at least 1");
        }
        if self.max_steps.is_none() && self.epochs == 0 {
            return bad("--epochs must be at least 1 (or give --max-steps)");
        }
        Ok(())
    }

    /// How each step is taken: `--accum` micro-batches, or `--fused-backward` (which needs
    /// checkpoint segments and no loss scaling, and works with accumulation). The one place
    /// the combination is checked.
    pub fn step_mode(&self) -> Result<StepMode> {
        StepMode::new(StepModeRequest {
            micro_batches: self.accum,
            fused_backward: self.fused_backward,
            checkpointing: self.checkpoint_strategy()?.segmented(),
            loss_scaling: self.planned_precision()?.loss_scaling,
        })
    }

    /// `--fit`'s budget in bytes, when given.
    pub fn fit_budget(&self) -> Result<Option<u64>> {
        self.fit
            .as_deref()
            .map(|s| {
                ft_params::bytes::parse_bytes(s)
                    .map_err(|e| Error::Invalid(format!("--fit {e}")))
                    .and_then(|b| match b {
                        0 => Err(Error::Invalid("--fit must be more than 0 bytes".into())),
                        b => Ok(b),
                    })
            })
            .transpose()
    }

    /// What `--fit` plans within: the budget less `--fit-reserve` (8% of it by default), when
    /// `--fit` is given.
    pub fn fit_target(&self) -> Result<Option<u64>> {
        let Some(budget) = self.fit_budget()? else {
            if let Some(r) = &self.fit_reserve {
                return Err(Error::Invalid(format!(
                    "--fit-reserve {r} without --fit: the reserve is held back from --fit's budget"
                )));
            }
            return Ok(None);
        };
        let text = self
            .fit_reserve
            .as_deref()
            .unwrap_or(DEFAULT_FIT_RESERVE)
            .trim();
        let bad = |why: &str| Err(Error::Invalid(format!("--fit-reserve {text}: {why}")));
        let reserve = if let Some(share) = text.strip_suffix('%') {
            match share.trim().parse::<f64>() {
                Ok(p) if (0.0..100.0).contains(&p) => (budget as f64 * p / 100.0).ceil() as u64,
                _ => return bad("expected a share from 0% to under 100%"),
            }
        } else {
            let digits = text
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(text.len());
            match text[..digits].parse::<f64>() {
                // 0, 0MiB: no reserve.
                Ok(0.0) => 0,
                // A bare number would be bytes, most likely by mistake.
                Ok(_) if digits == text.len() => {
                    return bad("give a share (8%) or a size with its unit (512MiB), or 0 for none")
                }
                _ => ft_params::bytes::parse_bytes(text)
                    .map_err(|e| Error::Invalid(format!("--fit-reserve {e}")))?,
            }
        };
        if reserve >= budget {
            return bad(&format!(
                "holds back the whole --fit budget of {}",
                super::plan::fmt(budget)
            ));
        }
        Ok(Some(budget - reserve))
    }

    /// The checkpointing strategy: `--checkpointing`, or `full` for `--gradient-checkpointing`.
    pub fn checkpoint_strategy(&self) -> Result<Strategy> {
        let given = match &self.checkpointing {
            Some(s) => Some(
                s.parse::<Strategy>()
                    .map_err(|e| Error::Invalid(format!("--{e}")))?,
            ),
            None => None,
        };
        match (given, self.gradient_checkpointing) {
            (Some(s), true) if s != Strategy::Full => Err(Error::Invalid(format!(
                "--gradient-checkpointing means --checkpointing full, and --checkpointing is {s}: \
                 give one of the two"
            ))),
            (Some(s), _) => Ok(s),
            (None, true) => Ok(Strategy::Full),
            (None, false) => Ok(Strategy::None),
        }
    }

    /// The `--device` as a candle device: `cpu`, `cuda` or `cuda:N` (`cuda` in a data-parallel
    /// run: the GPU of the rank's local rank).
    pub fn device(&self) -> Result<Device> {
        let cuda = |n: usize| {
            Device::new_cuda(n).map_err(|e| {
                Error::Invalid(format!(
                    "--device {}: CUDA device {n} could not be opened ({e}); without the `cuda` \
                     feature or a GPU, use --device cpu",
                    self.device
                ))
            })
        };
        let world = super::ranks::world()?;
        let device = match self.device.as_str() {
            "cpu" => Ok(Device::Cpu),
            // Each rank of a data-parallel run on its host's GPU `local_rank`.
            "cuda" => cuda(world.local_rank()),
            s => match s.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                Some(n) if world.world() > 1 => Err(Error::Invalid(format!(
                    "--device cuda:{n} with {} ranks would put them all on GPU {n}: give \
                     --device cuda, and each rank takes the GPU of its local rank",
                    world.world()
                ))),
                Some(n) => cuda(n),
                None => Err(Error::Invalid(format!(
                    "--device `{s}`: expected cpu, cuda or cuda:N"
                ))),
            },
        }?;
        // Several ranks on GPUs sum their gradients there, over NCCL (once a run).
        #[cfg(feature = "nccl")]
        if let (true, Device::Cuda(d)) = (world.world() > 1, &device) {
            world.join_gpus(d.cuda_stream())?;
        }
        Ok(device)
    }

    /// `--precision`, or bf16 with fp32 master weights on a GPU and f32 on the CPU (where some
    /// candle kernels, conv2d among them, have no bf16).
    pub fn precision(&self, device: &Device) -> Result<Precision> {
        self.precision_for(device.is_cpu())
    }

    /// The precision `--device` will get, without opening the device (for `--plan`).
    pub fn planned_precision(&self) -> Result<Precision> {
        self.precision_for(self.device == "cpu")
    }

    fn precision_for(&self, cpu: bool) -> Result<Precision> {
        if self.full_bf16 {
            return Ok(Precision::full_bf16());
        }
        match &self.precision {
            Some(p) => Precision::parse(p),
            None if cpu => Precision::parse("f32"),
            None => Precision::parse("bf16"),
        }
    }

    /// Optimizer steps of the run: `--max-steps`, else `--epochs` passes of
    /// `micro_batches_per_epoch` micro-batches grouped by `--accum`.
    pub fn max_steps(&self, micro_batches_per_epoch: usize) -> u64 {
        let per_epoch = micro_batches_per_epoch.div_ceil(self.accum.max(1)) as u64;
        self.max_steps
            .unwrap_or(per_epoch * self.epochs as u64)
            .max(1)
    }

    /// `--optim`'s entry in the optimizer registry.
    pub fn optim_spec(&self) -> Result<&'static OptimSpec> {
        registry::find(&self.optim)
    }

    /// The `--optim` optimizer (`--lr` through the schedule, `--weight-decay`) over `params`,
    /// with fp32 masters as the precision asks, on the host with `--offload-optimizer`, and
    /// clipping at `--max-grad-norm` (0 disables).
    pub fn optimizer(
        &self,
        params: Vec<(String, candle_core::Var)>,
        precision: Precision,
    ) -> Result<MixedOptimizer> {
        let clip = (self.max_grad_norm > 0.0).then_some(self.max_grad_norm);
        let spec = self.optim_spec()?;
        let settings = OptimSettings {
            weight_decay: self.weight_decay,
        };
        let placement = StatePlacement::offload(self.offload_optimizer);
        let mut opt = MixedOptimizer::new(
            params,
            precision,
            placement,
            |n| (spec.build)(n, &settings),
            clip,
        )?;
        // The stochastic rounding of weights without masters follows --seed, like the rest of
        // the run's randomness.
        if precision.stochastic_rounding && opt.masters().is_empty() {
            let seed = ft_params::rng::SplitMix64::new(self.seed ^ 0x5EED_0B16).next_u64();
            opt.optimizer_mut().set_stochastic_rounding(Some(seed));
        }
        if self.zero > 0 {
            opt.shard(self.zero, super::ranks::world()?)?;
        }
        Ok(opt)
    }

    /// The ranks a plan is for: `--plan-ranks`, else the ranks this process was launched with.
    pub fn planned_world(&self) -> Result<usize> {
        Ok(match self.plan_ranks {
            Some(n) => n,
            None => super::ranks::world()?.world(),
        })
    }

    /// The memory plan of training the trainable tensors of `store` (a loaded model, or one
    /// built from shapes only) with these flags under `precision`; `segments` are the model's
    /// checkpoint segments (each one's tensors): the gradients backward forms segment by segment, or under
    /// `--fused-backward` those it holds at once.
    pub fn state_plan(
        &self,
        store: &ft_params::ParamStore,
        segments: &[Vec<candle_core::Tensor>],
        precision: Precision,
    ) -> Result<StatePlan> {
        let shapes = store.shapes(true);
        let world = self.planned_world()?;
        let plan = state_plan(
            &shapes,
            &precision,
            StatePlacement::offload(self.offload_optimizer),
            self.optim_spec()?,
            self.accum,
            self.device != "cpu",
        );
        let segments = store.segments(segments);
        // The ranks' sums run on the GPUs over NCCL, else (and with the optimizer on the host)
        // through host memory.
        let gpu = self.device != "cpu";
        let on_gpus = gpu && cfg!(feature = "nccl") && !self.offload_optimizer;
        let through_host = gpu && !on_gpus;
        if self.fused_backward {
            // (Before the ranks' shares: with one micro-batch a step there are no sums.)
            return Ok(plan
                .under_fused_backward(segments.clone(), self.optim_spec()?)
                .per_rank(world, self.zero, &shapes, self.optim_spec()?)
                .rounds_under_fused_backward(
                    world,
                    self.zero,
                    self.accum,
                    &segments,
                    &shapes,
                    on_gpus,
                    through_host,
                ));
        }
        let plan = plan
            .per_rank(world, self.zero, &shapes, self.optim_spec()?)
            .formed_by_segment(&segments);
        // In segments, each one's gradients are added to the step's sums (over the ranks,
        // summed over them) as its backward ends.
        let plan = match self.checkpoint_strategy()?.segmented() {
            false if world > 1 => plan,
            false => plan.added_after_backward(),
            true if world > 1 => {
                plan.reduced_by_segment(world, self.zero, self.accum, &segments, &shapes)
            }
            true => plan.accumulated_by_segment(&segments),
        };
        Ok(plan.with_sums_in_flight(world, self.zero, self.accum, &shapes, on_gpus, through_host))
    }

    /// `plan` with the activations of one micro-batch, as `profile` counts them at `what` (the
    /// shapes planned for), under this run's `--checkpointing`.
    pub fn with_activations(
        &self,
        plan: StatePlan,
        what: &str,
        profile: &ft_params::checkpoint::ActivationProfile,
    ) -> Result<StatePlan> {
        Ok(plan.with_activations(what, profile, self.checkpoint_strategy()?))
    }

    /// For `--plan`: the precision the run will use and a builder that records the model's
    /// parameter shapes into the returned store without allocating them (on the CPU, nothing
    /// opened). Build the model with it, then pass the store to [`Self::state_plan`].
    pub fn shapes_builder(
        &self,
    ) -> Result<(
        ft_params::ParamBuilder,
        std::sync::Arc<ft_params::ParamStore>,
        Precision,
    )> {
        let precision = self.planned_precision()?;
        let store = ft_params::ParamStore::new();
        let pb = ft_params::ParamBuilder::new(store.clone(), precision.storage, &Device::Cpu, 0)
            .shapes_only();
        Ok((pb, store, precision))
    }

    /// The output folder, created unless this is a `--plan` (which writes nothing, except
    /// what `--demo` needs to write to be planned).
    pub fn create_output_dir(&self) -> Result<PathBuf> {
        let out = self.output_dir.clone();
        if !self.plan || self.demo {
            std::fs::create_dir_all(&out).map_err(|e| Error::io(&out, e))?;
        }
        Ok(out)
    }

    /// `--schedule` with `--lr` and `--warmup-steps` over `total_steps`.
    pub fn schedule(&self, total_steps: u64) -> Result<LrSchedule> {
        Ok(LrSchedule {
            kind: self.schedule.parse()?,
            base_lr: self.lr,
            warmup_steps: self.warmup_steps,
            total_steps,
        })
    }
}

/// Whether this build launches its own CUDA kernels (what an optimizer whose update exists only
/// as a kernel needs on a GPU).
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
