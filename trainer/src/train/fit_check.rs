//! A run under `--fit` measured against its plan: the binary run as a user runs it, in its own
//! process (so the counting allocator sees that run alone), and its `metrics.jsonl` read back.
//! The binaries' run-level tests check every row of their matrix with it, and their tables in
//! docs/benchmarks.md are its rows.

use std::path::Path;
use std::time::Instant;

use super::binary::{parse_args_from, Binary};
use super::metrics::logged;
use super::plan::{fmt, StatePlan};
use crate::error::{Error, Result};

/// A model and data to train on: the run's flags beside `--fit`, and its budgets as fractions
/// of the plan of those flags as they are (above 1: nothing to choose).
#[derive(Clone, Debug)]
pub struct Shape {
    pub label: String,
    pub args: Vec<String>,
    pub fractions: Vec<f64>,
}

impl Shape {
    pub fn new(label: &str, args: &[&str], fractions: &[f64]) -> Self {
        Shape {
            label: label.to_string(),
            args: args.iter().map(|s| s.to_string()).collect(),
            fractions: fractions.to_vec(),
        }
    }
}

/// One run under `--fit SIZE`: what it chose, what the plan predicted for the training phases
/// and what they measured (the last step's figures: the highest peak so far), and how often a
/// step passed the budget and was split.
#[derive(Clone, Debug)]
pub struct FitRun {
    /// The row's name in the table.
    pub label: String,
    pub budget: u64,
    /// What `--fit` chose: "as it is", or the flags.
    pub choice: String,
    pub predicted: u64,
    pub measured: u64,
    /// `out_of_memory` events: steps split because they passed the budget.
    pub splits: usize,
    pub seconds: f64,
}

impl FitRun {
    /// The header of [`FitRun::cells`]' rows.
    pub const HEADER: &'static str = "| run | --fit | chose | predicted | measured | error | \
                                      splits |\n|---|---|---|---|---|---|---|\n";

    /// Each shape at each of its budgets (fractions of the plan of its flags as they are, made
    /// by the binary's own `plan` as `--plan` makes it, `out/plan` its output folder),
    /// `out/<label>-<i>` the output folder of each run.
    pub fn matrix<B: Binary, E: std::fmt::Display>(
        bin: &Path,
        shapes: &[Shape],
        out: &Path,
        plan: impl Fn(&B) -> std::result::Result<StatePlan, E>,
    ) -> Result<Vec<FitRun>> {
        let mut rows = Vec::new();
        for s in shapes {
            let plan_dir = out.join("plan").display().to_string();
            let mut argv = vec!["plan".to_string(), "--output-dir".into(), plan_dir];
            argv.extend(s.args.iter().cloned());
            let whole = plan(&parse_args_from::<B, _, _>(argv)?)
                .map_err(|e| Error::Invalid(format!("{}: {e:#}", s.label)))?
                .device_bytes();
            for (i, f) in s.fractions.iter().enumerate() {
                let dir = out.join(format!("{}-{i}", s.label.replace([' ', ','], "-")));
                let budget = (whole as f64 * f) as u64;
                rows.push(FitRun::run(bin, &s.label, &s.args, budget, &dir)?);
            }
        }
        Ok(rows)
    }

    /// Prints the table of `rows`; every row that fails [`FitRun::check`], with why.
    pub fn table(rows: &[FitRun], high: f64, low: f64) -> std::result::Result<(), String> {
        print!("{}", Self::HEADER);
        for r in rows {
            println!("{}", r.cells());
        }
        let failed: Vec<String> = rows
            .iter()
            .filter_map(|r| r.check(high, low).err())
            .collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(failed.join("\n"))
        }
    }

    /// Runs `bin args --fit BUDGET --output-dir out --quiet` and reads what its metrics say;
    /// an error (with the run's stderr) when it fails or logged no step.
    pub fn run(bin: &Path, label: &str, args: &[String], budget: u64, out: &Path) -> Result<Self> {
        let t0 = Instant::now();
        let output = std::process::Command::new(bin)
            .args(args)
            .args(["--fit", &budget.to_string(), "--quiet", "--output-dir"])
            .arg(out)
            .output()
            .map_err(|e| Error::io(bin, e))?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            return Err(Error::Invalid(format!(
                "{label}: the run failed:\n{stderr}"
            )));
        }
        let choice = stderr
            .lines()
            .find_map(|l| l.strip_prefix("--fit "))
            .and_then(|l| l.split_once(": "))
            .and_then(|(_, rest)| rest.split(';').next())
            .map(|c| c.strip_prefix("chose ").unwrap_or("as it is").to_string())
            .ok_or_else(|| Error::Invalid(format!("{label}: no --fit line in\n{stderr}")))?;
        let metrics = out.join("metrics.jsonl");
        let last = |key: &str| -> Result<u64> {
            logged(&metrics, key)?
                .last()
                .and_then(|v| v.as_u64())
                .ok_or_else(|| Error::Invalid(format!("{label}: no {key} in metrics.jsonl")))
        };
        let splits = logged(&metrics, "event")?
            .iter()
            .filter(|e| e.as_str() == Some("out_of_memory"))
            .count();
        Ok(FitRun {
            label: label.to_string(),
            budget,
            choice,
            predicted: last("predicted_peak_bytes")?,
            measured: last("peak_bytes")?,
            splits,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// Measured over predicted, less one: negative when the plan was high.
    pub fn error(&self) -> f64 {
        self.measured as f64 / self.predicted.max(1) as f64 - 1.0
    }

    /// The row: label, budget, choice, predicted, measured, error, splits.
    pub fn cells(&self) -> String {
        format!(
            "| {} | {} | {} | {} | {} | {:+.1}% | {} |",
            self.label,
            fmt(self.budget),
            if self.choice == "as it is" {
                self.choice.clone()
            } else {
                format!("`{}`", self.choice)
            },
            fmt(self.predicted),
            fmt(self.measured),
            100.0 * self.error(),
            self.splits
        )
    }

    /// The plan was at most `high` above the measured peak and at most `low` below it
    /// (fractions of the prediction), and the run kept its budget without a split (`--fit`
    /// plans within the budget less its reserve, so a plan a little low still fits). Else why
    /// not.
    pub fn check(&self, high: f64, low: f64) -> std::result::Result<(), String> {
        let mut why = Vec::new();
        let e = self.error();
        if self.measured > self.budget {
            why.push("measured over the budget".to_string());
        }
        if self.splits > 0 {
            why.push(format!("{} steps split", self.splits));
        }
        if e < -high || e > low {
            why.push(format!(
                "error {:+.1}% outside -{:.0}%..+{:.0}%",
                100.0 * e,
                100.0 * high,
                100.0 * low
            ));
        }
        if why.is_empty() {
            Ok(())
        } else {
            Err(format!("{}: {}", self.cells(), why.join(", ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FitRun;

    fn row(choice: &str, predicted: u64, measured: u64, splits: usize) -> FitRun {
        FitRun {
            label: "r".into(),
            budget: 1000,
            choice: choice.into(),
            predicted,
            measured,
            splits,
            seconds: 0.0,
        }
    }

    #[test]
    fn a_row_passes_within_its_budget_and_tolerance_only() {
        let ok = |r: FitRun| r.check(0.12, 0.10).is_ok();
        assert!(ok(row("as it is", 950, 900, 0)));
        // The plan too high or too low.
        assert!(!ok(row("as it is", 950, 800, 0)));
        assert!(!ok(row("as it is", 800, 900, 0)));
        // Over the budget; any split, even where the plan was a little low (the reserve is
        // there for that).
        assert!(!ok(row("as it is", 1000, 1050, 0)));
        assert!(!ok(row("as it is", 950, 900, 1)));
        assert!(!ok(row("as it is", 940, 960, 1)));
        assert!(ok(row("as it is", 940, 960, 0)));
        // budget:B rows too: the run keeps the segments the plan keeps.
        assert!(!ok(row("--checkpointing budget:5MiB", 990, 600, 0)));
        assert!(ok(row("--checkpointing budget:5MiB", 990, 950, 0)));
    }
}
