//! What a run reports as it goes: `metrics.jsonl` (one line per step and per evaluation) and the
//! progress bar.

use std::io::Write as _;
use std::path::PathBuf;

use crate::error::{Error, Result};

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

pub(super) struct Metrics {
    path: PathBuf,
    /// `None` on the ranks of a data-parallel run other than rank 0, which alone writes.
    file: Option<std::fs::File>,
}

impl Metrics {
    pub(super) fn open(path: PathBuf, append: bool) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(append)
            .write(true)
            .truncate(!append)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        Ok(Metrics {
            path,
            file: Some(file),
        })
    }

    /// Metrics that are not written: another rank's.
    pub(super) fn off(path: PathBuf) -> Self {
        Metrics { path, file: None }
    }

    /// The metrics of a run resumed from the checkpoint of step `step`: the lines the earlier
    /// run logged after it (for steps the resumed run takes again) are dropped, then new lines
    /// are appended. The file is rewritten atomically.
    pub(super) fn resume(path: PathBuf, step: u64) -> Result<Self> {
        if let Ok(text) = std::fs::read_to_string(&path) {
            let kept: String = text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                        .is_none_or(|s| s <= step)
                })
                .map(|l| format!("{l}\n"))
                .collect();
            ft_params::fs::write_atomic(&path, |f| f.write_all(kept.as_bytes()))?;
        }
        Self::open(path, true)
    }

    pub(super) fn write(&mut self, v: serde_json::Value) -> Result<()> {
        match &mut self.file {
            Some(f) => writeln!(f, "{v}").map_err(|e| Error::io(&self.path, e)),
            None => Ok(()),
        }
    }
}

/// The progress bar of a run of `max_steps` steps, at `step` (a resumed run starts there):
/// step, loss, samples/s and memory in its message, ETA; hidden with `show` off.
pub(super) fn progress_bar(max_steps: u64, step: u64, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new(max_steps);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{elapsed_precise} [{bar:30}] step {pos}/{len} {msg} eta {eta}",
    ) {
        b.set_style(style.progress_chars("=> "));
    }
    b.set_position(step);
    b
}
