//! The memory plan of a run before it allocates: the model-state bytes by component and where
//! each lives (the training device or the host), from the trainable tensors' sizes and the
//! run's precision, optimizer and state placement, and the activations one micro-batch keeps
//! for its backward under the `--checkpointing` strategy, from the model's activation formulas
//! at the run's largest shapes (`ft_models::activations`, tested against real graphs). Every
//! binary prints it before training and with `--plan` instead of training (the model then built
//! from shapes only, nothing allocated); the ledger measures what really happens. Backward's
//! own temporaries (the gradients of activations in flight, kernels' buffers) are an estimate
//! ([`ft_params::checkpoint::Temporaries`]). `segments.rs`: the gradients handed on segment by
//! segment (the fused backward, one process's sums); `ranks.rs`: one rank's share under ZeRO
//! and the sums over the ranks.

use candle_core::DType;

use ft_params::bytes::format_bytes;
use ft_params::checkpoint::{ActivationProfile, GradBytes, Held, StepTemporaries, Strategy};

use crate::optim::OptimSpec;
use crate::update::{Precision, StatePlacement};

mod ranks;
mod segments;

/// One component of the model states.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRow {
    pub component: String,
    pub bytes: u64,
    /// Held in host memory rather than on the training device.
    pub on_host: bool,
    /// Activations rather than model states.
    pub activation: bool,
    /// Taken from the total rather than added: what the other rows count twice (backward
    /// frees segment graphs before it has formed every gradient).
    pub less: bool,
}

impl PlanRow {
    /// The row's bytes with their sign in the total.
    fn signed(&self) -> i128 {
        if self.less {
            -(self.bytes as i128)
        } else {
            self.bytes as i128
        }
    }
}

/// A sum of rows, never below zero.
fn total<'a>(rows: impl Iterator<Item = &'a PlanRow>) -> u64 {
    rows.map(PlanRow::signed).sum::<i128>().max(0) as u64
}

/// The model-state bytes of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct StatePlan {
    pub params: u64,
    pub rows: Vec<PlanRow>,
    /// Whether the training device is a GPU (else the host is the device).
    pub gpu: bool,
    /// Micro-batches a step.
    accum: usize,
    /// The rows of one micro-batch's gradients in their dtype (on the device, and moved to the
    /// host), and that dtype's size: what a fused backward pass bounds.
    grad_rows: Vec<usize>,
    grad_size: u64,
    /// What the activation rows count, once added.
    activations: Option<Held>,
    /// The rows of the optimizer state and of the fp32 gradient sums (with accumulation):
    /// what ZeRO partitions ([`StatePlan::per_rank`]).
    state_row: usize,
    sums_row: Option<usize>,
    masters_row: Option<usize>,
    /// The optimizer step's temporaries on the training device, by where the step runs
    /// (counted with the activations, [`StatePlan::with_activations`]); zeros where the step
    /// allocates none there (in-place CUDA kernels, or the state on the host of a GPU run).
    step: StepTemporaries,
    /// Whether the step's temporaries are on the training device.
    step_on_device: bool,
    /// The gradients backward forms, segment by segment ([`StatePlan::formed_by_segment`]).
    formed: Option<GradBytes>,
    /// Planned under the fused backward ([`StatePlan::under_fused_backward`]).
    fused: bool,
    /// What the sums over a data-parallel run's ranks hold after backward on the training
    /// device ([`StatePlan::with_sums_in_flight`]): their buffers while they run, and what the
    /// sums hold beyond the gradients they replace until the step has read them.
    in_flight: u64,
    excess: u64,
    /// The most values one round of a backward that sums each segment's gradients over the
    /// ranks carries ([`StatePlan::reduced_by_segment`]): its bucket's bound.
    round_values: Option<u64>,
    /// In such a backward, each segment's round: its bucket's values, its largest tensor's and
    /// the bytes of the sums arrived by then ([`StatePlan::reduced_by_segment`]), then what the
    /// round holds at that segment's moment of the backward
    /// ([`StatePlan::with_sums_in_flight`]).
    segment_rounds: Vec<(u64, u64, u64)>,
    round_moments: Vec<u64>,
    /// With one micro-batch a step on the CPU, the fp32 sums over the ranks that reach this
    /// rank in such a backward: counted at the moments they are there (`segment_rounds`, and
    /// all of them after the backward) rather than as a row held all along.
    arriving: u64,
    /// Under the fused backward across ranks, each segment's round on the training device and
    /// the rest's, last ([`StatePlan::rounds_under_fused_backward`]): its peak, and the sums
    /// its step reads beside its own temporaries.
    rounds: Vec<(u64, u64)>,
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "fp32",
        _ => "other",
    }
}

/// The plan for trainable tensors of these shapes, trained with `optim`.
pub fn state_plan(
    shapes: &[Vec<usize>],
    precision: &Precision,
    placement: StatePlacement,
    optim: &OptimSpec,
    accum: usize,
    gpu: bool,
) -> StatePlan {
    let n: u64 = shapes
        .iter()
        .map(|s| s.iter().product::<usize>() as u64)
        .sum();
    let w = precision.storage.size_in_bytes() as u64;
    let host = placement == StatePlacement::Host;
    let dt = dtype_name(precision.storage);
    let mut rows = vec![
        (format!("weights ({dt})"), w * n, false),
        (format!("one micro-batch's gradients ({dt})"), w * n, false),
    ];
    let mut grad_rows = vec![1];
    let mut sums_row = None;
    // One micro-batch a step: its gradients are what the optimizer reads (`GradAccumulator`
    // widens only from the second), moved to the host in their dtype when the state is there.
    if accum > 1 {
        sums_row = Some(rows.len());
        rows.push((
            "gradient sums (fp32, accumulated across micro-batches)".into(),
            4 * n,
            host,
        ));
    } else if host && gpu {
        grad_rows.push(rows.len());
        rows.push((
            format!("the step's gradients ({dt}), moved to the host"),
            w * n,
            true,
        ));
    }
    let mut masters_row = None;
    if host || (precision.master_weights && precision.storage != DType::F32) {
        masters_row = Some(rows.len());
        rows.push(("fp32 master weights".into(), 4 * n, host));
    }
    let moments = shapes.iter().map(|s| (optim.state_bytes)(s)).sum();
    // On a GPU the step is the in-place kernels' or runs on the host with the state; on the
    // CPU (and with candle ops on a GPU) its temporaries are the device's.
    let step_on_device = !gpu || (!host && !optim.in_place_on_gpu);
    let step = StepTemporaries {
        after: largest_step(optim, shapes.iter())
            .filter(|_| step_on_device)
            .unwrap_or(0),
        ..StepTemporaries::default()
    };
    let state_row = rows.len();
    rows.push((optim.state_label.into(), moments, host));
    StatePlan {
        params: n,
        rows: rows
            .into_iter()
            .map(|(component, bytes, on_host)| PlanRow {
                component,
                bytes,
                on_host,
                activation: false,
                less: false,
            })
            .collect(),
        gpu,
        accum,
        grad_rows,
        grad_size: w,
        activations: None,
        state_row,
        sums_row,
        masters_row,
        step,
        step_on_device,
        formed: None,
        fused: false,
        in_flight: 0,
        excess: 0,
        round_values: None,
        segment_rounds: Vec::new(),
        round_moments: Vec::new(),
        arriving: 0,
        rounds: Vec::new(),
    }
}

/// The largest step temporaries `optim` makes for one of `shapes` (`None` for none).
fn largest_step<'a>(
    optim: &OptimSpec,
    shapes: impl Iterator<Item = &'a Vec<usize>>,
) -> Option<u64> {
    shapes.map(|d| (optim.step_bytes)(d)).max()
}

impl StatePlan {
    /// Adds a component (an EMA, say) to the plan.
    pub fn with(mut self, component: &str, bytes: u64, on_host: bool) -> Self {
        self.rows.push(PlanRow {
            component: component.into(),
            bytes,
            on_host,
            activation: false,
            less: false,
        });
        self
    }

    /// Adds the activations one micro-batch keeps under `strategy`, as `profile` (the model's
    /// formulas at `what`, the shapes planned for) counts them: what stays from forward to
    /// backward, what backward adds at most (the segment it rebuilds, its temporaries), and
    /// what `full-host` keeps in host memory.
    pub fn with_activations(
        mut self,
        what: &str,
        profile: &ActivationProfile,
        strategy: Strategy,
    ) -> Self {
        // The sums over the ranks run after backward, before the step: the moment holds the
        // larger of their buffers and the step's temporaries (and the fp32 sums' excess, which
        // the step then reads).
        let mut step = self.step.clone();
        if self.in_flight > 0 {
            step.after = step.after.max(self.in_flight) + self.excess;
        }
        // Summed a segment at a time, each round comes inside the backward, beside the graphs
        // it still holds (the last, the rest's, after it: `in_flight`).
        if !self.round_moments.is_empty() && self.rounds.is_empty() {
            step.segments = self.round_moments.clone();
        }
        // Under the fused backward across ranks, each segment's moment holds its round, then
        // its step beside the sums (the rest's after the backward).
        let largest_round = self
            .rounds
            .iter()
            .map(|r| r.0)
            .chain(self.round_moments.iter().copied())
            .max()
            .unwrap_or(0);
        if let Some(((rest_peak, rest_sums), own)) = self.rounds.split_last() {
            if step.segments.len() != own.len() {
                step.segments = vec![0; own.len()];
            }
            for (s, (peak, sums)) in step.segments.iter_mut().zip(own) {
                *s = (*s + sums).max(*peak);
            }
            step.after = (step.after + rest_sums).max(*rest_peak);
            step.fused = true;
        }
        let held = profile.held_with(strategy, &step, self.formed.as_ref());
        let mut rows = Vec::new();
        let mut row = |component: String, bytes: u64, on_host: bool| {
            rows.push(PlanRow {
                component,
                bytes,
                on_host,
                activation: true,
                less: false,
            })
        };
        row(
            format!("activations kept for backward ({what}, --checkpointing {strategy})"),
            held.kept,
            false,
        );
        if held.backward > 0 {
            let rebuilt = if held.recompute > 0 {
                format!(
                    "the segment it rebuilds (the largest {}), ",
                    fmt(held.recompute)
                )
            } else {
                String::new()
            };
            row(
                format!(
                    "during backward, on top at most: {rebuilt}its temporaries (gradients in \
                     flight, kernels' buffers; estimated), less the graphs it has freed"
                ),
                held.backward,
                false,
            );
        }
        if held.step > 0 {
            let (largest, when) = if self.step.fused {
                (
                    self.step
                        .segments
                        .iter()
                        .copied()
                        .chain([self.step.after])
                        .max(),
                    "inside the fused backward, beside the graphs it still holds",
                )
            } else {
                (Some(self.step.after), "after backward has freed the graph")
            };
            let sums = match (self.in_flight > self.step.after, self.excess) {
                (false, 0) => String::new(),
                (true, 0) => format!(
                    " or the gradients' sums over the ranks in flight ({})",
                    fmt(self.in_flight)
                ),
                (false, x) => format!(", with the fp32 sums over the ranks ({} more)", fmt(x)),
                (true, x) => format!(
                    " or the gradients' sums over the ranks in flight ({}), with their fp32 \
                     sums ({} more)",
                    fmt(self.in_flight),
                    fmt(x)
                ),
            };
            let rounds = match largest_round {
                0 => String::new(),
                r => format!(
                    " or a round of the gradients' sums over the ranks ({})",
                    fmt(r)
                ),
            };
            row(
                format!(
                    "the optimizer step's temporaries ({} for the largest tensor it updates, \
                     {when}){sums}{rounds}: above backward's peak by",
                    fmt(largest.unwrap_or(0))
                ),
                held.step,
                false,
            );
        }
        if held.host > 0 {
            row(
                "tensors between segments (full-host)".into(),
                held.host,
                true,
            );
        }
        if held.spare > 0 {
            rows.push(PlanRow {
                component: "less what the rows above count twice: at backward's peak it has \
                            freed some segment graphs and not yet formed every gradient"
                    .into(),
                bytes: held.spare,
                on_host: false,
                activation: true,
                less: true,
            });
        }
        self.rows.extend(rows);
        self.activations = Some(held);
        self
    }

    /// The activations the plan counts (kept from forward to backward, rebuilt during it, in
    /// host memory), when they have been added.
    pub fn activations(&self) -> Option<Held> {
        self.activations
    }

    /// Model-state bytes on the training device (everything but the activations).
    pub fn state_device_bytes(&self) -> u64 {
        total(self.device_rows().filter(|r| !r.activation))
    }

    /// Activation bytes on the training device at most.
    pub fn activation_device_bytes(&self) -> u64 {
        total(self.device_rows().filter(|r| r.activation))
    }

    fn device_rows(&self) -> impl Iterator<Item = &PlanRow> {
        self.rows.iter().filter(|r| !self.gpu || !r.on_host)
    }

    /// Bytes on the training device at most (everything, when that is the CPU).
    pub fn device_bytes(&self) -> u64 {
        total(self.device_rows())
    }

    /// Bytes in host memory kept apart from a GPU (0 when training on the CPU).
    pub fn host_bytes(&self) -> u64 {
        if !self.gpu {
            return 0;
        }
        total(self.rows.iter().filter(|r| r.on_host))
    }

    /// A markdown table: each component with its place, then the totals.
    pub fn table(&self) -> String {
        let device = if self.gpu { "GPU" } else { "CPU" };
        let what = if self.activations.is_some() {
            "and the activations of one micro-batch with backward's temporaries"
        } else {
            "(activations come on top)"
        };
        let mut s = format!(
            "memory plan, model states of {} trainable parameters {what}:\n\
             | component | where | bytes |\n|---|---|---|\n",
            self.params
        );
        for r in &self.rows {
            let at = if self.gpu && r.on_host {
                "host"
            } else {
                device
            };
            let sign = if r.less { "-" } else { "" };
            s += &format!("| {} | {at} | {sign}{} |\n", r.component, fmt(r.bytes));
        }
        if self.activations.is_some() {
            s += &format!(
                "| model states on the {device} | {device} | {} |\n\
                 | activations and step temporaries on the {device} | {device} | {} |\n",
                fmt(self.state_device_bytes()),
                fmt(self.activation_device_bytes())
            );
        }
        s += &format!(
            "| total on the {device} | {device} | {} |\n",
            fmt(self.device_bytes())
        );
        if self.gpu {
            s += &format!(
                "| total in host memory | host | {} |\n",
                fmt(self.host_bytes())
            );
        }
        s
    }

    /// The table, then the host-memory warning when there is one: what a run prints before it
    /// starts and `--plan` prints instead of running.
    pub fn report(&self) -> String {
        match self.host_warning() {
            Some(w) => format!("{}{w}\n", self.table()),
            None => self.table(),
        }
    }

    /// A warning when the host state of a GPU run exceeds the host memory available now.
    pub fn host_warning(&self) -> Option<String> {
        let need = self.host_bytes();
        let have = host_available()?;
        (need > have).then(|| {
            format!(
                "warning: the state planned for host memory needs {}, and {} is available now: \
                 the run may swap or be killed (8-bit moments, --optim adamw8bit, need a quarter \
                 of fp32 ones)",
                fmt(need),
                fmt(have)
            )
        })
    }
}

/// Bytes as the plans print them (`format_bytes` takes signed deltas).
pub(crate) fn fmt(b: u64) -> String {
    format_bytes(b as i64)
}

/// `MemAvailable` of /proc/meminfo in bytes (Linux); `None` elsewhere.
pub fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
