//! `--fit SIZE`: the settings that make the memory plan fit a budget on the training device,
//! chosen cheapest first, keeping every setting the user gave.
//!
//! The knobs, in the order they are turned (each one only when the user set none of its flags,
//! on the command line or in `--config`):
//!
//! 1. `--checkpointing`: `none`, then `budget:B` keeping as much as fits (the last blocks
//!    that fit in B kept, the earlier ones recomputed), then `full`, then `full-host`.
//!    (`blocks` and `every:K` are not tried: `budget` keeps as much within the same bytes, and
//!    keeps the blocks backward frees first.)
//! 2. The binary's own (sdxl-ft: the EMA on the host, `--ema-device cpu`).
//! 3. The optimizer state: 8-bit AdamW moments (`--optim adamw8bit`, when the run uses AdamW),
//!    then on the host (`--offload-optimizer`, GPU runs only). Adafactor is not chosen: it is
//!    another optimizer (no first moment, factored second), not a smaller form of the user's.
//! 4. `--fused-backward` (with a checkpointing strategy: the model's gradients never exist at
//!    once).
//! 5. The micro-batch: `--batch-size` divided, `--accum` multiplied by the same factor, so the
//!    effective batch is the one asked for.
//!
//! The precision is not turned: bf16 with fp32 masters is already the GPU default, and
//! `--full-bf16` changes how updates round, which is the user's call.
//!
//! The search plans within the budget less `--fit-reserve` (8% by default): a plan is an
//! estimate, and one a little low would pack the budget past its end, where the run, held to
//! the whole budget, would split its micro-batches after the fact.
//!
//! The search: knob by knob, the earlier ones at their most saving level (the one with the
//! smallest plan), each level of the current knob is tried, cheapest first; at the first plan
//! that fits, the earlier knobs are walked back,
//! in order, to the cheapest level that still fits, again until none moves. The predicted peak is the plan's total on
//! the training device: model states, activations, and backward's temporaries as each model's
//! measured factors estimate them (`ft_params::checkpoint::Temporaries`).

use std::collections::BTreeSet;

use super::binary::Binary;
use super::plan::{fmt, StatePlan};
use crate::error::{Error, Result};

/// How a level changes the arguments.
pub enum Setting<A> {
    /// Flags set as written.
    Flags(Box<dyn Fn(&mut A)>),
    /// `--checkpointing budget:B`, B what the segments kept by the largest B whose plan fits
    /// the `--fit` budget hold (found during the search).
    CheckpointBudget,
}

/// One setting of a knob: how it reads as flags, and how it changes the arguments.
pub struct Level<A> {
    pub flags: String,
    pub setting: Setting<A>,
}

/// A setting `--fit` may choose, with the flags (TOML keys) that, when the user gave any of
/// them, leave it alone; its levels go from the cheapest (the arguments as they are) to the
/// most memory-saving.
pub struct Knob<A> {
    pub name: &'static str,
    pub keys: &'static [&'static str],
    pub levels: Vec<Level<A>>,
}

impl<A> Knob<A> {
    pub fn new(name: &'static str, keys: &'static [&'static str]) -> Self {
        Knob {
            name,
            keys,
            levels: Vec::new(),
        }
    }

    /// Adds a level: `flags` as the user would type them.
    pub fn level(mut self, flags: impl Into<String>, apply: impl Fn(&mut A) + 'static) -> Self {
        self.levels.push(Level {
            flags: flags.into(),
            setting: Setting::Flags(Box::new(apply)),
        });
        self
    }
}

/// The arguments `--fit` chose, their plan, and what it changed.
pub struct Fitted<A> {
    pub args: A,
    pub plan: StatePlan,
    /// `--fit`'s budget, which the run is held to.
    pub budget: u64,
    /// What the choice was planned within: the budget less `--fit-reserve`.
    pub target: u64,
    /// The flags chosen, as the user would type them (empty: the run fits as it is).
    pub chosen: Vec<String>,
}

impl<A> Fitted<A> {
    /// What `--fit` prints before the run (and with `--plan`, before the plan).
    pub fn report(&self) -> String {
        let peak = self.plan.device_bytes();
        let choice = if self.chosen.is_empty() {
            "the run fits as it is".to_string()
        } else {
            format!("chose {}", self.chosen.join(" "))
        };
        format!(
            "--fit {}: {choice}; predicted peak {} on the {} ({:.0}% of the budget; backward's \
             temporaries estimated; planned within {}, {} held in reserve)\n",
            fmt(self.budget),
            fmt(peak),
            if self.plan.gpu { "GPU" } else { "CPU" },
            100.0 * peak as f64 / self.budget as f64,
            fmt(self.target),
            fmt(self.budget - self.target)
        )
    }

    /// The choice as the cells of a markdown row: the flags (or "as it is"), the predicted peak
    /// on the training device, the bytes in host memory (the seed-setup tables of the README).
    pub fn cells(&self) -> String {
        let chosen = if self.chosen.is_empty() {
            "as it is".to_string()
        } else {
            format!("`{}`", self.chosen.join(" "))
        };
        format!(
            "{chosen} | {} | {}",
            fmt(self.plan.device_bytes()),
            fmt(self.plan.host_bytes())
        )
    }
}

/// The knobs every binary shares, for arguments `args` (levels only where they change
/// something), with the binary's own (`Binary::fit_knobs`) after the checkpointing.
fn knobs<B: Binary>(args: &B) -> Vec<Knob<B>> {
    let c = args.common();
    let mut out = Vec::new();
    let mut checkpointing = Knob::new(
        "checkpointing",
        &["checkpointing", "gradient_checkpointing"],
    );
    checkpointing.levels.push(Level {
        flags: "--checkpointing budget".into(),
        setting: Setting::CheckpointBudget,
    });
    out.push(
        checkpointing
            .level("--checkpointing full", |a: &mut B| {
                a.common_mut().checkpointing = Some("full".into())
            })
            .level("--checkpointing full-host", |a: &mut B| {
                a.common_mut().checkpointing = Some("full-host".into())
            }),
    );
    out.extend(args.fit_knobs());
    let mut optim = Knob::new("optimizer state", &["optim", "offload_optimizer"]);
    if c.optim == "adamw" {
        optim = optim.level("--optim adamw8bit", |a: &mut B| {
            a.common_mut().optim = "adamw8bit".into()
        });
    }
    if c.device != "cpu" && !c.full_bf16 {
        let eight_bit = c.optim == "adamw";
        let flags = if eight_bit {
            "--optim adamw8bit --offload-optimizer"
        } else {
            "--offload-optimizer"
        };
        optim = optim.level(flags, move |a: &mut B| {
            if eight_bit {
                a.common_mut().optim = "adamw8bit".into();
            }
            a.common_mut().offload_optimizer = true;
        });
    }
    out.push(optim);
    out.push(
        Knob::new("fused backward", &["fused_backward"]).level("--fused-backward", |a: &mut B| {
            a.common_mut().fused_backward = true
        }),
    );
    let (batch, accum) = (c.batch_size, c.accum);
    let mut micro = Knob::new("micro-batch", &["batch_size", "accum"]);
    for d in (1..batch).rev().filter(|d| batch % d == 0) {
        let k = batch / d;
        micro = micro.level(
            format!("--batch-size {d} --accum {}", accum * k),
            move |a: &mut B| {
                a.common_mut().batch_size = d;
                a.common_mut().accum = accum * k;
            },
        );
    }
    out.push(micro);
    out
}

/// The level `l` of knob `k` (0: as given; `i`: the knob's level `i - 1`).
fn level<B>(k: &Knob<B>, l: usize) -> Option<&Level<B>> {
    l.checked_sub(1).and_then(|i| k.levels.get(i))
}

/// The arguments with the knobs at `levels`, a `budget:B` level at `budget_bytes`.
fn with_levels<B: Binary + Clone>(
    args: &B,
    knobs: &[Knob<B>],
    levels: &[usize],
    budget_bytes: u64,
) -> B {
    let mut a = args.clone();
    for (k, &l) in knobs.iter().zip(levels) {
        match level(k, l).map(|l| &l.setting) {
            None => {}
            Some(Setting::Flags(f)) => f(&mut a),
            Some(Setting::CheckpointBudget) => {
                a.common_mut().checkpointing = Some(budget_flag(budget_bytes))
            }
        }
    }
    a
}

/// `budget:B` as a user would type it: in MiB when `bytes` is a whole number of them, else in
/// KiB (rounded down; at least 1 KiB).
fn budget_flag(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("budget:{}MiB", bytes >> 20)
    } else {
        format!("budget:{}KiB", (bytes >> 10).max(1))
    }
}

/// Runs `plan` over the arguments `--fit` may choose and returns the cheapest that fits, or
/// `None` without `--fit`. An error when nothing fits: naming the given settings that stand in
/// the way and what the plan would be without them, or the smallest plan there is.
pub fn fit<B: Binary + Clone, E: std::fmt::Display>(
    args: &B,
    plan: impl Fn(&B) -> std::result::Result<StatePlan, E>,
) -> Result<Option<Fitted<B>>> {
    let (Some(budget), Some(target)) = (args.common().fit_budget()?, args.common().fit_target()?)
    else {
        return Ok(None);
    };
    // The arguments as given must make a run: their own error otherwise, not a search.
    args.common().validate()?;
    plan(args).map_err(|e| Error::Invalid(format!("{e:#}")))?;
    let given = args.common().given.clone();
    let within = if target < budget {
        format!(
            "{} (planned within {}: --fit-reserve {})",
            fmt(budget),
            fmt(target),
            args.common()
                .fit_reserve
                .as_deref()
                .unwrap_or(super::cli::DEFAULT_FIT_RESERVE)
        )
    } else {
        fmt(budget)
    };
    match search(args, &plan, target, &given)? {
        Ok(mut f) => {
            f.budget = budget;
            Ok(Some(f))
        }
        Err(smallest) => {
            // Would it fit if the given settings could change?
            let frozen: Vec<&'static str> = knobs(args)
                .iter()
                .flat_map(|k| k.keys.iter().copied())
                .filter(|key| given.contains(*key))
                .collect();
            let free = search(args, &plan, target, &BTreeSet::new())?;
            let flags = |keys: &[&str]| {
                keys.iter()
                    .map(|k| format!("--{}", k.replace('_', "-")))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            Err(Error::Invalid(match (frozen.is_empty(), free) {
                (false, Ok(f)) => format!(
                    "--fit {}: not with {} as given (the smallest plan with them needs {}); \
                     it fits with {} (predicted {})",
                    within,
                    flags(&frozen),
                    fmt(smallest),
                    f.chosen.join(" "),
                    fmt(f.plan.device_bytes())
                ),
                _ => format!(
                    "--fit {}: no setting fits; the smallest plan needs {} (smaller images, \
                     sequences or batches, or a device with more memory)",
                    within,
                    fmt(smallest)
                ),
            }))
        }
    }
}

/// `args` as `--fit` chooses them (the report printed to stderr), or as they are without
/// `--fit`: what each binary's `main` runs (or plans, with `--plan`).
pub fn apply<B: Binary + Clone, E: std::fmt::Display>(
    args: B,
    plan: impl Fn(&B) -> std::result::Result<StatePlan, E>,
) -> Result<B> {
    Ok(match fit(&args, plan)? {
        Some(f) => {
            super::ranks::say(f.report());
            f.args
        }
        None => args,
    })
}

/// The cheapest arguments that fit, or the smallest predicted peak when none does.
fn search<B: Binary + Clone, E: std::fmt::Display>(
    args: &B,
    plan: &impl Fn(&B) -> std::result::Result<StatePlan, E>,
    budget: u64,
    given: &BTreeSet<String>,
) -> Result<std::result::Result<Fitted<B>, u64>> {
    let knobs: Vec<Knob<B>> = knobs(args)
        .into_iter()
        .filter(|k| !k.levels.is_empty() && !k.keys.iter().any(|key| given.contains(*key)))
        .collect();
    let mut smallest = u64::MAX;
    // The peak of the arguments at `levels`, None when the combination is not a valid run
    // (the fused backward without segments, say).
    let mut peak = |levels: &[usize]| -> Result<Option<(B, StatePlan)>> {
        let mut a = with_levels(args, &knobs, levels, 0);
        let budget_at = knobs.iter().zip(levels).position(|(k, &l)| {
            matches!(
                level(k, l).map(|l| &l.setting),
                Some(Setting::CheckpointBudget)
            )
        });
        if budget_at.is_some() {
            // B: the largest that fits, bisected in the unit the flag is written in (whole
            // MiB, KiB for budgets under 4 MiB). A B whose plan does not fit is taken as an
            // upper end even where the plan is not monotone in B (it keeps whole segments);
            // the caller checks the final plan.
            let unit: u64 = if budget >= 4 << 20 { 1 << 20 } else { 1 << 10 };
            let kept_at = |b: u64| -> Result<Option<StatePlan>> {
                try_plan(plan, &with_levels(args, &knobs, levels, b))
            };
            let (mut lo, mut hi) = (0, budget / unit + 1);
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                let Some(p) = kept_at(mid * unit)? else {
                    return Ok(None);
                };
                if p.device_bytes() <= budget {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            // Then B = what the segments kept there hold (rounded up to the unit): the last
            // segments that fit in it are the same ones, and B is not left just short of
            // keeping one more, where a segment the run measures a little smaller than
            // planned would be kept as well. Nothing kept: this level is `full`'s.
            let kept = |p: Option<StatePlan>| p.and_then(|p| p.activations()).map_or(0, |h| h.kept);
            let b = kept(kept_at(lo * unit)?).saturating_sub(kept(kept_at(0)?));
            if b == 0 {
                return Ok(None);
            }
            a = with_levels(args, &knobs, levels, b.div_ceil(unit) * unit);
        }
        let p = try_plan(plan, &a)?;
        if let Some(p) = &p {
            smallest = smallest.min(p.device_bytes());
        }
        Ok(p.map(|p| (a, p)))
    };
    let fits = |p: &StatePlan| p.device_bytes() <= budget;
    let mut levels = vec![0; knobs.len()];
    if let Some((a, p)) = peak(&levels)? {
        if fits(&p) {
            return Ok(Ok(fitted(a, p, budget, &knobs, &levels)));
        }
    }
    for k in 0..knobs.len() {
        // The knob's level with the smallest plan, where the next knobs are tried: usually its
        // last, but not always (Conv4's checkpointing rebuilds a first block that holds most
        // of the activations, and its backward's temporaries come on top: `full` plans more
        // than `none`).
        let mut least = (
            peak(&levels)?.map_or(u64::MAX, |(_, p)| p.device_bytes()),
            0,
        );
        for l in 1..=knobs[k].levels.len() {
            levels[k] = l;
            let Some((_, p)) = peak(&levels)? else {
                continue;
            };
            least = least.min((p.device_bytes(), l));
            if !fits(&p) {
                continue;
            }
            // Walk the earlier knobs back to the cheapest level that still fits, until none
            // moves: a knob walked back can free an earlier one (without the fused backward,
            // the checkpointing may go back to `none`, which the fused backward refuses).
            loop {
                let before = levels.clone();
                for j in 0..k {
                    for cheaper in 0..levels[j] {
                        let mut trial = levels.clone();
                        trial[j] = cheaper;
                        if let Some((_, p)) = peak(&trial)? {
                            if fits(&p) {
                                levels = trial;
                                break;
                            }
                        }
                    }
                }
                if levels == before {
                    break;
                }
            }
            let Some((a, p)) = peak(&levels)? else {
                continue;
            };
            return Ok(Ok(fitted(a, p, budget, &knobs, &levels)));
        }
        levels[k] = least.1;
    }
    Ok(Err(smallest))
}

/// The plan of `a`, or None when the shared checks refuse the combination the knobs made (the
/// fused backward without segments, say). Any other error (a missing file) is the same for
/// every combination, and ends the search.
fn try_plan<B: Binary, E: std::fmt::Display>(
    plan: &impl Fn(&B) -> std::result::Result<StatePlan, E>,
    a: &B,
) -> Result<Option<StatePlan>> {
    if a.common().validate().is_err() {
        return Ok(None);
    }
    plan(a)
        .map(Some)
        .map_err(|e| Error::Invalid(format!("{e:#}")))
}

fn fitted<B: Binary>(
    args: B,
    plan: StatePlan,
    budget: u64,
    knobs: &[Knob<B>],
    levels: &[usize],
) -> Fitted<B> {
    let chosen = knobs
        .iter()
        .zip(levels)
        .filter_map(|(k, &l)| level(k, l))
        .map(|l| match l.setting {
            Setting::CheckpointBudget => format!(
                "--checkpointing {}",
                args.common().checkpointing.clone().unwrap_or_default()
            ),
            Setting::Flags(_) => l.flags.clone(),
        })
        .collect();
    Fitted {
        args,
        plan,
        budget,
        target: budget,
        chosen,
    }
}
