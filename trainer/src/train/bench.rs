//! What the bench commands share: timing a train step after a warm-up, its peak memory two ways
//! (the counting allocator's exact heap peak and the resident-set high-water mark, which is what
//! the PyTorch side can report too), and running a PyTorch reference script in the same run.

use std::time::Instant;

/// A field of /proc/self/status in KiB (`VmRSS`, `VmHWM`); 0 where unavailable.
pub fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Minor page faults of the process so far (all threads; /proc/self/stat), 0 where unavailable:
/// memory first touched (or touched again after the allocator gave it back) costs one each.
pub fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the command name (which may hold spaces) start at its closing ')';
            // minflt is field 10 of the whole line, the 8th after that.
            let rest = s.rsplit_once(')')?.1;
            rest.split_whitespace().nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

/// Resets the resident-set high-water mark (Linux); false where it cannot.
pub fn reset_hwm() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Time and peak memory of a train step.
#[derive(Debug, Clone, Copy)]
pub struct StepMeasure {
    /// Mean seconds per step.
    pub step_s: f64,
    /// Heap peak above the level after the warm-up (needs [`crate::ledger::alloc::CountingAlloc`]).
    pub alloc_peak: u64,
    /// Resident-set peak above the level after the warm-up, where it can be reset. The counting
    /// allocator keeps what the warm-up mapped ([`crate::ledger::block_cache`]) where PyTorch's
    /// glibc gives much of it back, so beside PyTorch's this is not like for like:
    /// [`StepMeasure::rss_from_start`] is.
    pub rss_peak: Option<u64>,
    /// Resident-set peak above the level before the warm-up, the warm-up step included: what
    /// the steps need, with what the process keeps between steps counted (the post-warm-up
    /// measure puts that in its base, and the two sides of a bench keep different amounts,
    /// [`StepMeasure::rss_kept`]), and with the warm-up's one-time costs too (optimizer state,
    /// library code and thread stacks first touched). `None` after the first measure in a
    /// process, which starts above what earlier ones left.
    pub rss_from_start: Option<u64>,
    /// Resident set after the warm-up step above the level before it (floored at zero); `None`
    /// where `/proc` cannot be read and after the first measure in a process, as
    /// [`StepMeasure::rss_from_start`].
    pub rss_kept: Option<u64>,
}

/// Bytes for a bench table, "-" where the measure is missing.
pub fn bytes_or_dash(b: Option<u64>) -> String {
    b.map(|b| ft_params::bytes::format_bytes(b as i64))
        .unwrap_or_else(|| "-".into())
}

/// The line a bench prints (on stderr) for what each side's warm-up left resident
/// ([`StepMeasure::rss_kept`]), or `None` where neither side has it.
pub fn kept_line(ours: Option<u64>, torch: Option<u64>) -> Option<String> {
    (ours.is_some() || torch.is_some()).then(|| {
        format!(
            "resident after the warm-up above the level before it: ours {}, PyTorch {}",
            bytes_or_dash(ours),
            bytes_or_dash(torch)
        )
    })
}

/// Whether a measure in this process has started (see [`StepMeasure::rss_from_start`]).
static MEASURED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs `step` once as a warm-up (so optimizer state exists), then `steps` times measured.
pub fn measure_steps<E>(
    steps: usize,
    mut step: impl FnMut() -> std::result::Result<(), E>,
) -> std::result::Result<StepMeasure, E> {
    let first = !MEASURED.swap(true, std::sync::atomic::Ordering::Relaxed);
    let start_rss = rss_kib("VmRSS");
    let reset = reset_hwm();
    step()?;
    let warm_up_hwm = rss_kib("VmHWM");
    let base_rss = rss_kib("VmRSS");
    let reset = reset && reset_hwm();
    let base = crate::ledger::alloc::reset_peak() as u64;
    let t0 = Instant::now();
    for _ in 0..steps.max(1) {
        step()?;
    }
    let step_s = t0.elapsed().as_secs_f64() / steps.max(1) as f64;
    let peak = crate::ledger::alloc::peak_bytes() as u64;
    Ok(StepMeasure {
        step_s,
        alloc_peak: peak.saturating_sub(base),
        rss_peak: reset.then(|| rss_kib("VmHWM").saturating_sub(base_rss) * 1024),
        rss_from_start: (reset && first).then(|| {
            let hwm = rss_kib("VmHWM").max(warm_up_hwm);
            hwm.saturating_sub(start_rss) * 1024
        }),
        rss_kept: (reset && first).then(|| base_rss.saturating_sub(start_rss) * 1024),
    })
}

/// Runs `python script args...` (python from `BENCH_PYTHON`, default `python3`) and parses the
/// last line of its output as JSON; `None` (with the reason on stderr) when it cannot run.
pub fn python_reference(script: &str, args: &[String]) -> Option<serde_json::Value> {
    let py = std::env::var("BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(&py)
        .arg(script)
        .args(args)
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "PyTorch reference not run ({py}): {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
        return None;
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last()?).ok()
}

/// The model-state bytes of `n` parameters trained as the binaries do (bf16 weights, fp32
/// masters, AdamW, gradients summed in fp32 over micro-batches), with the optimizer state
/// beside the model and with `--offload-optimizer`: a markdown table for the bench plans, from
/// the same [`super::plan`] the binaries print.
pub fn model_states_table(n: u64) -> String {
    use crate::update::{Precision, StatePlacement};
    use ft_params::bytes::format_bytes;
    let precision = Precision::for_dtype(candle_core::DType::BF16);
    let plan = |placement| {
        let shapes = [vec![n as usize]];
        super::plan::state_plan(
            &shapes,
            &precision,
            placement,
            &crate::optim::adamw::SPEC,
            // Accumulation: fp32 gradient sums, the "at most" of the table.
            2,
            true,
        )
    };
    let (near, host) = (plan(StatePlacement::WithModel), plan(StatePlacement::Host));
    let b = |v: u64| format_bytes(v as i64);
    let mut s = String::from(
        "| component | optimizer on the GPU | --offload-optimizer: GPU | --offload-optimizer: host |\n\
         |---|---|---|---|\n",
    );
    for (a, o) in near.rows.iter().zip(&host.rows) {
        let (gpu, cpu) = if o.on_host {
            ("-".into(), b(o.bytes))
        } else {
            (b(o.bytes), "-".into())
        };
        s += &format!("| {} | {} | {gpu} | {cpu} |\n", a.component, b(a.bytes));
    }
    s += &format!(
        "| model states, at most | {} | {} | {} |\n",
        b(near.device_bytes()),
        b(host.device_bytes()),
        b(host.host_bytes())
    );
    s
}

/// The CPU benches' optimizer: AdamW with PyTorch's defaults over the store's trainable f32
/// parameters, state beside them, no clipping (what their PyTorch references run).
pub fn f32_adamw(store: &ft_params::ParamStore) -> crate::Result<crate::update::MixedOptimizer> {
    use crate::update::{MixedOptimizer, Precision, StatePlacement};
    MixedOptimizer::adamw(
        store.trainable()?,
        Precision::for_dtype(candle_core::DType::F32),
        StatePlacement::WithModel,
        crate::optim::AdamWConfig::default(),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a process's first measure starts clean, so a later one gives neither the peak
    /// above start nor what its warm-up kept (with the gating gone, the second measure would
    /// report both where `/proc` can be read, as here).
    #[test]
    fn only_the_first_measure_reports_from_start() {
        let step = || -> std::result::Result<(), ()> {
            std::hint::black_box(vec![1u8; 1 << 20]);
            Ok(())
        };
        let _first = measure_steps(1, step);
        let second = measure_steps(1, step).expect("the step does not fail");
        assert_eq!(second.rss_from_start, None);
        assert_eq!(second.rss_kept, None);
        assert!(second.step_s >= 0.0);
    }

    #[test]
    fn kept_line_needs_a_measure() {
        assert_eq!(kept_line(None, None), None);
        let line = kept_line(Some(2048), None).expect("ours is there");
        assert!(
            line.contains("ours 2.00 KiB") && line.ends_with("PyTorch -"),
            "{line}"
        );
    }
}
