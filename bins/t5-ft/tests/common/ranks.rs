//! What t5-ft's data-parallel tests (`ranks.rs`, `ranks_faults.rs`) share: runs as ranks,
//! with a failure made on purpose, and what a run leaves (ledger, metrics, weights).

#![allow(dead_code)] // each of the two test files uses some

use std::path::{Path, PathBuf};

use anyhow::{ensure, Result};
use ft_params::weights::SafetensorsFiles;

pub const BIN: &str = env!("CARGO_BIN_EXE_t5-ft");

/// Trains as `np` ranks into `out` and returns the step losses; fails on a failed run.
pub fn train(np: usize, out: &Path, args: &[&str]) -> Result<Option<Vec<f64>>> {
    Ok(ft_trainer::train::ranks::train_as_ranks(
        np, BIN, args, out,
    )?)
}

/// The rows of the run's ledger (`memory.jsonl`, rank 0's).
pub fn ledger(dir: &Path) -> Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(dir.join("memory.jsonl"))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// The bytes of `component` the ledger held after the run's last step.
pub fn held(dir: &Path, component: &str) -> Result<u64> {
    let rows = ledger(dir)?;
    let last = rows
        .iter()
        .rev()
        .find(|r| r["phase"] == "step")
        .ok_or_else(|| anyhow::anyhow!("no step in {}", dir.display()))?;
    last["told"][component]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no {component} in {last}"))
}

/// The most bytes of `component` the ledger held at any point of the run.
pub fn held_most(dir: &Path, component: &str) -> Result<u64> {
    Ok(ledger(dir)?
        .iter()
        .filter_map(|r| r["told"][component].as_u64())
        .max()
        .unwrap_or(0))
}

/// The small model trained from scratch on `data` in micro-batches of 2, at lr 1e-3.
pub fn from_scratch<'a>(model: &'a str, data: &'a str) -> Vec<&'a str> {
    vec![
        "--model",
        model,
        "--from-scratch",
        "--train-file",
        data,
        "--batch-size",
        "2",
        "--lr",
        "1e-3",
    ]
}

/// Flags both resume tests start from: [`from_scratch`] with a checkpoint every 2 steps.
pub fn small_run<'a>(model: &'a str, data: &'a str) -> Vec<&'a str> {
    [&from_scratch(model, data)[..], &["--save-every", "2"]].concat()
}

/// Flags of the equality tests: [`from_scratch`] for 3 steps of `accum` micro-batches.
pub fn three_steps<'a>(model: &'a str, data: &'a str, accum: &'a str) -> Vec<&'a str> {
    [
        &from_scratch(model, data)[..],
        &["--accum", accum, "--max-steps", "3"],
    ]
    .concat()
}

/// 2 ranks of `args` into `out` with the failure `fault` made on purpose (`FT_FAULT`), under a
/// 300 s limit; the launch's output (whatever its status), or None without `mpirun`.
pub fn with_fault(args: &[&str], out: &Path, fault: &str) -> Result<Option<std::process::Output>> {
    let Some(mut cmd) = ft_dist::ranks_of(2, BIN)? else {
        return Ok(None);
    };
    Ok(Some(
        cmd.args(args)
            .arg("--output-dir")
            .arg(out)
            .arg("--quiet")
            .env("FT_FAULT", fault)
            .env("MPIEXEC_TIMEOUT", "300")
            .output()?,
    ))
}

/// A run's metrics.jsonl: every line, the out-of-memory events, and the steps' lines.
pub type Lines = Vec<serde_json::Value>;
pub fn metrics(out: &Path) -> Result<(Lines, Lines, Lines)> {
    let lines: Lines = std::fs::read_to_string(out.join("metrics.jsonl"))?
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let pick =
        |f: &dyn Fn(&serde_json::Value) -> bool| lines.iter().filter(|l| f(l)).cloned().collect();
    let events = pick(&|l| l["event"] == "out_of_memory");
    let steps = pick(&|l| l.get("loss").is_some());
    Ok((lines, events, steps))
}

pub fn weights(dir: &Path) -> Result<SafetensorsFiles> {
    Ok(SafetensorsFiles::open(&[dir.join("model.safetensors")])?)
}

/// The demo's model with dropout 0.1 (so that a micro-batch's masks matter), 10 short examples
/// (5 micro-batches of 2 an epoch), under `dir`.
pub fn model_and_data(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let demo = dir.join("demo");
    let d = demo.display().to_string();
    let plan = std::process::Command::new(BIN)
        .args(["--demo", "--plan", "--output-dir", &d])
        .output()?;
    ensure!(
        plan.status.success(),
        "{}",
        String::from_utf8_lossy(&plan.stderr)
    );
    let model = dir.join("model");
    std::fs::create_dir_all(&model)?;
    std::fs::copy(
        demo.join("demo-data/model/tokenizer.json"),
        model.join("tokenizer.json"),
    )?;
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(demo.join("demo-data/model/config.json"))?)?;
    cfg["dropout_rate"] = 0.1.into();
    std::fs::write(model.join("config.json"), cfg.to_string())?;
    let text = std::fs::read_to_string(demo.join("demo-data/train.jsonl"))?;
    let data = dir.join("small.jsonl");
    let lines: Vec<&str> = text.lines().take(10).collect();
    std::fs::write(&data, lines.join("\n") + "\n")?;
    Ok((model, data))
}
