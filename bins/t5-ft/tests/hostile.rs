//! t5-ft as a user runs it, on hostile input: the built binary, its exit status and its stderr.
//! Each case was a failure once (issue 17) or is one that must stay fixed: one clear error
//! naming the file, line, tensor or flag and status 1, never a panic, a silent fallback or a
//! non-finite checkpoint.

#[path = "../../../tests/hostile/run.rs"]
mod hostile;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use ft_params::weights::SafetensorsFiles;
use hostile::{arg, fresh, run, safetensors_under, Ran};

const BIN: &str = env!("CARGO_BIN_EXE_t5-ft");

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/t5_tiny/flan")
}

/// The demo into `out`, two steps unless `extra` says otherwise.
fn demo(out: &Path, extra: &[&str]) -> Ran {
    let out = arg(out);
    let mut v = vec![
        "--demo",
        "--quiet",
        "--output-dir",
        &out,
        "--eval-limit",
        "4",
    ];
    if !extra.contains(&"--max-steps") {
        v.extend(["--max-steps", "2"]);
    }
    v.extend_from_slice(extra);
    run(BIN, &v)
}

/// The tiny fixture model on `train` into `out`.
fn on_file(model: &Path, train: &Path, out: &Path, extra: &[&str]) -> Ran {
    let (model, train, out) = (arg(model), arg(train), arg(out));
    let mut v = vec![
        "--model",
        &model,
        "--train-file",
        &train,
        "--output-dir",
        &out,
        "--quiet",
    ];
    v.extend_from_slice(extra);
    run(BIN, &v)
}

/// Every tensor in every .safetensors under `dir` is finite.
fn all_finite(dir: &Path) -> anyhow::Result<bool> {
    for f in safetensors_under(dir) {
        let files = SafetensorsFiles::open(&[f])?;
        for n in files.names() {
            let t = files.load(n, None, DType::F32, &Device::Cpu, false)?;
            let v: Vec<f32> = t.flatten_all()?.to_vec1()?;
            if v.iter().any(|x| !x.is_finite()) {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// A copy of the fixture model folder into `dir` with `weights` as its model.safetensors
/// (None: no weights file).
fn model_copy(dir: &Path, weights: Option<&[(String, Tensor)]>) -> anyhow::Result<PathBuf> {
    let m = dir.join("model");
    std::fs::create_dir_all(&m)?;
    for f in ["config.json", "tokenizer.json", "generation_config.json"] {
        std::fs::copy(fixture().join(f), m.join(f))?;
    }
    if let Some(w) = weights {
        ft_params::fs::save_safetensors(w, &m.join("model.safetensors"))?;
    }
    Ok(m)
}

fn fixture_weights() -> anyhow::Result<Vec<(String, Tensor)>> {
    let files = SafetensorsFiles::open(&[fixture().join("model.safetensors")])?;
    let names: Vec<String> = files.names().map(str::to_string).collect();
    names
        .into_iter()
        .map(|n| {
            let t = files.load(&n, None, DType::F32, &Device::Cpu, false)?;
            Ok((n, t))
        })
        .collect()
}

#[test]
fn weights_that_are_missing_corrupt_or_non_finite_are_refused_by_name() -> anyhow::Result<()> {
    let dir = fresh("t5", "weights");
    let train = fixture().join("train.jsonl");
    // Only pytorch_model.bin: no silent random init.
    let m = model_copy(&dir.join("bin"), None)?;
    std::fs::write(m.join("pytorch_model.bin"), b"not read")?;
    on_file(&m, &train, &dir.join("o1"), &["--max-steps", "1"]).fails_naming(&[
        "model.safetensors",
        "pytorch_model.bin",
        "--from-scratch",
    ]);
    // Truncated weights name the file.
    let m = model_copy(&dir.join("cut"), None)?;
    let bytes = std::fs::read(fixture().join("model.safetensors"))?;
    std::fs::write(m.join("model.safetensors"), &bytes[..bytes.len() / 2])?;
    on_file(&m, &train, &dir.join("o2"), &["--max-steps", "1"])
        .fails_naming(&["model.safetensors"]);
    // A weight holding NaN names the tensor.
    let mut w = fixture_weights()?;
    let name = w[0].0.clone();
    w[0].1 = (w[0].1.clone() * f64::NAN)?;
    let m = model_copy(&dir.join("nan"), Some(&w))?;
    on_file(&m, &train, &dir.join("o3"), &["--max-steps", "1"])
        .fails_naming(&[&name, "model.safetensors"]);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn flags_and_records_that_cannot_work_are_refused_by_name() -> anyhow::Result<()> {
    let dir = fresh("t5", "flags");
    for (flag, value) in [
        ("--weight-decay", "NaN"),
        ("--max-grad-norm", "NaN"),
        ("--lr", "nan"),
        ("--lr", "0"),
    ] {
        demo(&dir.join("o"), &[flag, value]).fails_naming(&[flag]);
    }
    let train = fixture().join("train.jsonl");
    on_file(&fixture(), &train, &dir.join("o"), &["--epochs", "0"]).fails_naming(&["--epochs"]);
    on_file(
        &fixture(),
        &dir.join("absent.jsonl"),
        &dir.join("o"),
        &["--max-steps", "1"],
    )
    .fails_naming(&["absent.jsonl"]);
    // A line that is not UTF-8 names its line; --skip-bad-lines skips it; a BOM is ignored.
    let good = br#"{"input": "reverse: 1 2", "target": "2 1"}"#;
    let mut bytes = b"\xEF\xBB\xBF".to_vec();
    bytes.extend_from_slice(good);
    bytes.extend_from_slice(b"\n{\"input\": \"x \xFF\", \"target\": \"y\"}\n");
    bytes.extend_from_slice(good);
    bytes.push(b'\n');
    let mixed = dir.join("mixed.jsonl");
    std::fs::write(&mixed, bytes)?;
    on_file(&fixture(), &mixed, &dir.join("o"), &["--max-steps", "1"])
        .fails_naming(&["mixed.jsonl:2"]);
    on_file(
        &fixture(),
        &mixed,
        &dir.join("o"),
        &["--max-steps", "1", "--skip-bad-lines"],
    )
    .succeeds();
    // A malformed JSON line names file and line.
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"input\": \"a\", \"target\": \"b\"}\n{\"input\": \n",
    )?;
    on_file(&fixture(), &bad, &dir.join("o"), &["--max-steps", "1"]).fails_naming(&["bad.jsonl:2"]);
    // Values at the edge of a u64 are the flag's own, not blamed on a config file.
    demo(
        &dir.join("o"),
        &["--max-steps", "1", "--warmup-steps", "18446744073709551615"],
    )
    .succeeds();
    demo(&dir.join("o"), &["--max-steps", "1", "--no-shuffle"]).succeeds();
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// `--lr 1e10` diverges: the run stops with one error after --max-bad-steps bad steps in a row,
/// and nothing it saved holds inf or NaN. (At 1e6 the loss reaches 1e13 in 40 steps but stays
/// finite since GELU's backward is one exact pass.)
#[test]
fn a_diverging_run_stops_and_saves_nothing_non_finite() -> anyhow::Result<()> {
    let dir = fresh("t5", "diverge");
    let r = demo(
        &dir,
        &["--lr", "1e10", "--max-steps", "40", "--save-every", "1"],
    );
    r.fails_naming(&["diverged", "--max-bad-steps"]);
    r.says("update skipped");
    assert!(all_finite(&dir)?, "a saved file holds inf or NaN");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// One run per output folder: a second run while the first trains gets one error naming the
/// folder and the first run's process; after the first is killed (SIGKILL, no cleanup) the
/// folder is free again.
#[test]
fn a_second_run_into_a_busy_folder_is_refused_and_a_killed_run_leaves_no_lock() -> anyhow::Result<()>
{
    let dir = fresh("t5", "lock");
    let out = arg(&dir);
    let mut first = Command::new(BIN)
        .args(["--demo", "--quiet", "--output-dir", &out])
        .args(["--max-steps", "100000", "--eval-every", "0"])
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    // The lock is taken once the session starts; the demo's files are written before it.
    let started = Instant::now();
    let lock = dir.join(".ft-run.lock");
    while !(lock.is_file() && std::fs::read_to_string(&lock)?.contains("process")) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the first run never took its lock"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    let second = demo(&dir, &["--max-steps", "1"]);
    first.kill()?;
    first.wait()?;
    second.fails_naming(&[&out, &first.id().to_string()]);
    demo(&dir, &["--max-steps", "1"]).succeeds();
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// A resume from a checkpoint missing an optimizer tensor, or with a step that is not a count,
/// is refused by name; a sound resume logs each step once in metrics.jsonl; every saved file has
/// the umask's mode, the weights like the JSON beside them.
#[test]
fn resume_is_checked_and_logs_each_step_once() -> anyhow::Result<()> {
    let dir = fresh("t5", "resume");
    let out = dir.join("run");
    demo(&out, &["--max-steps", "4", "--save-every", "2"]).succeeds();
    let ck = out.join("checkpoint-2");
    #[cfg(unix)]
    assert_eq!(
        hostile::mode(&ck.join("model.safetensors")),
        hostile::mode(&ck.join("trainer_state.json")),
        "weights and JSON get the same mode"
    );
    // Resuming from step 2 into the same folder: steps 3 and 4 are logged once, not twice.
    let ck_arg = arg(&ck);
    demo(&out, &["--max-steps", "4", "--resume", &ck_arg]).succeeds();
    let steps: Vec<u64> = std::fs::read_to_string(out.join("metrics.jsonl"))?
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .filter_map(|v| v["step"].as_u64())
        .collect();
    assert_eq!(steps, vec![1, 2, 3, 4]);

    // An optimizer file missing a tensor.
    let broken = dir.join("broken");
    copy_dir(&ck, &broken)?;
    let opt = broken.join("optimizer.safetensors");
    let files = SafetensorsFiles::open(std::slice::from_ref(&opt))?;
    let mut names: Vec<String> = files.names().map(str::to_string).collect();
    names.sort();
    let dropped = names.pop().unwrap_or_default();
    let kept = names
        .iter()
        .map(|n| {
            Ok((
                n.clone(),
                files.load(n, None, DType::F32, &Device::Cpu, false)?,
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    drop(files);
    ft_params::fs::save_safetensors(&kept, &opt)?;
    let broken_arg = arg(&broken);
    demo(
        &dir.join("r1"),
        &["--max-steps", "4", "--resume", &broken_arg],
    )
    .fails_naming(&[&dropped, "optimizer.safetensors"]);
    // A global_step that is not a count.
    let negative = dir.join("negative");
    copy_dir(&ck, &negative)?;
    let state = negative.join("trainer_state.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&state)?)?;
    v["global_step"] = (-5).into();
    std::fs::write(&state, v.to_string())?;
    let negative_arg = arg(&negative);
    demo(
        &dir.join("r2"),
        &["--max-steps", "4", "--resume", &negative_arg],
    )
    .fails_naming(&["global_step", "trainer_state.json"]);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// Intermediate evaluations print as lines when stderr is piped (no progress bar).
#[test]
fn evaluation_lines_print_when_piped() {
    let dir = fresh("t5", "piped");
    let r = demo(&dir, &["--max-steps", "4", "--eval-every", "2"]);
    r.succeeds().says("step 2: ").says("step 4: ");
    std::fs::remove_dir_all(&dir).ok();
}

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        std::fs::copy(e.path(), to.join(e.file_name()))?;
    }
    Ok(())
}
