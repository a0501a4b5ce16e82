//! The loop itself: steps ([`super::step`]: gather the micro-batches, forward, backward and the
//! update as the [`crate::update::StepMode`] says); after each, the ledger's marks, a metrics
//! line, the progress bar, the non-finite guard, and the evaluation and save schedule.
//!
//! In a data-parallel run each rank gathers its share of the step's micro-batches (every
//! `world`-th of the step's sequence, numbered as one process would number them), the loss is
//! normalised by the units of all ranks, and the gradients are summed over the ranks before the
//! update, so every rank takes the update one process would take over all the micro-batches.
//! Rank 0 alone writes metrics and checkpoints, evaluates and prints.

use std::time::Instant;

use ft_params::bytes::format_bytes;
use ft_params::checkpoint::Checkpointer;

use super::eval::Best;
use super::metrics::{progress_bar, Metrics};
use super::ranks;
use super::saved::load_checkpoint_state;
use super::settings::{LoopConfig, RunSummary};
use super::step::Loop;
use super::task::Task;
use crate::error::{Error, Result};
use crate::ledger::{measure, Ledger};
use crate::update::{GradAccumulator, MixedOptimizer};

/// Runs the loop over `task` with `opt` until `cfg.max_steps` (or early stopping).
pub fn run<T: Task>(
    task: &mut T,
    opt: &mut MixedOptimizer,
    checkpointer: &Checkpointer,
    ledger: &mut Ledger,
    cfg: &LoopConfig,
) -> Result<RunSummary> {
    std::fs::create_dir_all(&cfg.output_dir).map_err(|e| Error::io(&cfg.output_dir, e))?;
    let comm = ranks::world()?;
    let main = comm.is_main();
    let (mut step, mut epoch) = (0u64, 0usize);
    let mut summary = RunSummary::default();
    let mut best = Best::new(cfg.best.clone());
    let metrics_path = cfg.output_dir.join("metrics.jsonl");
    let (mut halvings, mut events) = (0, Vec::new());
    let mut metrics = if let Some(dir) = &cfg.resume {
        let st = load_checkpoint_state(dir, opt)?;
        (step, epoch) = (st.progress.step, st.progress.epoch);
        if let Some(s) = st.progress.split {
            let message = if s.batch_size == cfg.batch_size {
                halvings = s.halvings;
                format!(
                    "resuming with each micro-batch split in {} parts, as the checkpoint's run \
                     split them after running out of memory",
                    1u64 << s.halvings.min(63)
                )
            } else {
                format!(
                    "the checkpoint's run split its micro-batches of {} in {} parts after running \
                     out of memory; this run's micro-batches of {} start whole",
                    s.batch_size,
                    1u64 << s.halvings.min(63),
                    cfg.batch_size
                )
            };
            events.push(serde_json::json!({
                "step": step, "event": "resumed_split", "halvings": halvings,
                "message": message,
            }));
        }
        task.restore_data_state(&st.data).map_err(Error::Task)?;
        if let Some(b) = st.progress.best {
            best.restore(b);
            summary.best = Some((b.value, cfg.output_dir.join("best")));
        }
        // The steps an interrupted run logged after its checkpoint are done again: drop them.
        if main {
            Metrics::resume(metrics_path, step)?
        } else {
            Metrics::off(metrics_path)
        }
    } else {
        task.start_epoch(epoch).map_err(Error::Task)?;
        if main {
            Metrics::open(metrics_path, false)?
        } else {
            Metrics::off(metrics_path)
        }
    };
    opt.account(ledger, "model");
    ledger.mark("load", step)?;
    ledger.training_starts();
    let bar = Voice {
        bar: progress_bar(cfg.max_steps, step, cfg.progress && main),
        main,
    };
    if comm.world() > 1 {
        let a = cfg.mode.micro_batches();
        bar.say(&format!(
            "data parallel over {} ranks ({}): micro-batches of {} x {a} a rank x {} ranks = \
             an effective batch of {} a step",
            comm.world(),
            comm.launch().launcher,
            cfg.batch_size,
            comm.world(),
            cfg.batch_size * a * comm.world()
        ));
    }
    let mut l = Loop {
        comm: comm.clone(),
        params: opt.params().to_vec(),
        acc: GradAccumulator::on(&opt.state_device()),
        task,
        opt,
        checkpointer,
        ledger,
        cfg,
        step,
        epoch,
        halvings,
        updating: false,
        halve_next: None,
        events,
    };
    let mut bad_in_a_row = 0u64;
    while l.step < cfg.max_steps {
        let t0 = Instant::now();
        let r = l.train_step();
        for e in l.events.drain(..) {
            if let Some(text) = e.get("message").and_then(|m| m.as_str()) {
                bar.say(text);
            }
            metrics.write(e)?;
        }
        let r = r?;
        let secs = t0.elapsed().as_secs_f64();
        summary.losses.push(r.loss);
        let live = measure::read_live(l.opt.params().first().map(|p| p.device()));
        let per_s = r.samples as f64 / secs.max(1e-9);
        let (predicted, measured) = l.ledger.peak_against_plan().unzip();
        metrics.write(serde_json::json!({
            "step": l.step, "epoch": l.epoch, "loss": r.loss, "lr": r.lr,
            "grad_norm": r.outcome.grad_norm, "skipped": !r.outcome.applied,
            "non_finite": r.outcome.non_finite,
            "samples_per_s": per_s, "step_time_s": secs, "memory_bytes": live,
            "updated_in_backward": cfg.mode.fused_backward().then_some(r.updated_in_backward),
            "peak_bytes": measured, "predicted_peak_bytes": predicted,
            "micro_batches": r.pieces,
        }))?;
        let split = if l.halvings > 0 {
            format!(" ({} passes a step, split)", r.pieces)
        } else {
            String::new()
        };
        bar.bar.set_message(format!(
            "loss {:.4} {per_s:.1} samples/s mem {}{split}",
            r.loss,
            format_bytes(live as i64)
        ));
        bar.bar.set_position(l.step);
        if r.outcome.non_finite {
            bad_in_a_row += 1;
            let what = if r.bad_loss {
                format!("loss {}", r.loss)
            } else {
                "gradient inf/NaN".to_string()
            };
            bar.say(&format!("step {}: {what}, update skipped", l.step));
            if cfg.max_bad_steps > 0 && bad_in_a_row >= cfg.max_bad_steps {
                bar.bar.abandon();
                return Err(Error::Diverged(format!(
                    "{bad_in_a_row} steps in a row (the last: step {}, {what}) had a non-finite \
                     loss or gradient, and their updates were skipped: the run has diverged. \
                     Nothing non-finite was saved{}; lower --lr, raise --warmup-steps or clip \
                     with --max-grad-norm (--max-bad-steps sets how many to allow in a row)",
                    l.step,
                    summary
                        .final_dir
                        .as_ref()
                        .map(|d| format!(" (the last checkpoint is {})", d.display()))
                        .unwrap_or_default()
                )));
            }
        } else {
            bad_in_a_row = 0;
        }

        let step = l.step;
        let last = step == cfg.max_steps;
        if (cfg.eval_every > 0 && step.is_multiple_of(cfg.eval_every)) || last {
            // Rank 0 evaluates (and keeps the best checkpoint); it tells the others whether to
            // stop early.
            // [stop early, a new best to save]
            let mut stop = [0u8; 2];
            if main {
                l.ledger.mark("eval/before", step)?;
                let m = l.task.evaluate(step, l.ledger).map_err(Error::Task)?;
                l.ledger.mark("eval/after", step)?;
                metrics.write(eval_line(step, &m))?;
                if !m.is_empty() {
                    bar.say(&format!("step {step}: {}", eval_text(&m)));
                }
                if let Some(v) = best.improved(&m) {
                    summary.best = Some((v, cfg.output_dir.join("best")));
                    stop[1] = 1;
                }
                summary.last_eval = m;
                if best.should_stop() && !last {
                    bar.say(&format!(
                        "early stopping at step {step}: no improvement in {} evaluations",
                        best.bad_evals()
                    ));
                    stop[0] = 1;
                }
            }
            if !main {
                l.task.serve_evaluation().map_err(Error::Task)?;
            }
            comm.broadcast(&mut stop, 0)?;
            if stop[1] == 1 {
                l.save_as(&best, "best")?;
            }
            if stop[0] == 1 {
                summary.final_dir = Some(l.save(&best)?);
                summary.stopped_early = true;
                break;
            }
        }
        if (cfg.save_every > 0 && step.is_multiple_of(cfg.save_every)) || last {
            summary.final_dir = Some(l.save(&best)?);
        }
    }
    bar.bar.finish();
    summary.steps = l.step;
    Ok(summary)
}

/// Where the run speaks: the progress bar and the lines above it, on rank 0 only.
struct Voice {
    bar: indicatif::ProgressBar,
    main: bool,
}

impl Voice {
    /// A line for the reader: above the progress bar, or on stderr when there is none
    /// (`--quiet`, or output piped to a file), so evaluations and warnings are never lost to a
    /// hidden bar. Other ranks than 0 say nothing.
    fn say(&self, line: &str) {
        if !self.main {
            return;
        }
        if self.bar.is_hidden() {
            eprintln!("{line}");
        } else {
            self.bar.println(line);
        }
    }
}

/// An evaluation's metrics line: `eval_{name}` for each metric.
fn eval_line(step: u64, m: &[(String, f64)]) -> serde_json::Value {
    let mut line = serde_json::Map::new();
    line.insert("step".into(), step.into());
    for (k, v) in m {
        line.insert(format!("eval_{k}"), serde_json::json!(v));
    }
    serde_json::Value::Object(line)
}

fn eval_text(m: &[(String, f64)]) -> String {
    m.iter()
        .map(|(k, v)| format!("{k} {v:.4}"))
        .collect::<Vec<_>>()
        .join(", ")
}
