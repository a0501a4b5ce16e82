//! The ledger itself: told bytes by category and place, profile points measured at tagged
//! phases, the JSONL timeline, and leak suspicion over the points.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use ft_params::bytes::tensor_bytes;

use super::measure::{self, Reading};
use super::Category;
use crate::error::{Error, Result};

/// One profile point: a phase tag, the step, and what was told and measured there.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfilePoint {
    pub phase: String,
    pub step: u64,
    /// Seconds since the ledger was made.
    pub at: f64,
    /// Measured bytes in use at the point.
    pub live: u64,
    /// Measured high-water mark since the previous point (the peak of the phase that just ended).
    pub peak: u64,
    /// `live` minus the baseline's `live` (0 before a baseline is set).
    pub delta: i64,
    /// Told bytes per category at the point, of what lives in the measured memory.
    pub told: BTreeMap<Category, u64>,
    /// Told bytes per category that live in host memory while the ledger measures a GPU
    /// (offloaded optimizer state, an EMA kept on the host): not part of `live`.
    pub host: BTreeMap<Category, u64>,
}

impl ProfilePoint {
    /// Measured bytes that no told category explains: activations, temporaries and other.
    pub fn unaccounted(&self) -> i64 {
        self.live as i64 - self.told.values().sum::<u64>() as i64
    }
}

/// A phase whose live bytes at its profile points kept growing: a possible leak.
#[derive(Debug, Clone, PartialEq)]
pub struct LeakSuspect {
    pub phase: String,
    pub first_delta: i64,
    pub last_delta: i64,
    pub occurrences: usize,
}

/// The ledger of one run on one device.
pub struct Ledger {
    pub(super) device: Device,
    told: BTreeMap<Category, BTreeMap<String, u64>>,
    host: BTreeMap<Category, BTreeMap<String, u64>>,
    baseline: Option<u64>,
    pub(super) points: Vec<ProfilePoint>,
    timeline: Option<(PathBuf, std::io::BufWriter<std::fs::File>)>,
    /// The plan's bytes on the device (every run's plan, as `--plan` prints it), to compare
    /// with what is measured.
    predicted: Option<u64>,
    /// What the run held above the baseline before its first step besides the bytes it told
    /// (see [`Ledger::training_starts`]).
    unplanned: Option<u64>,
    /// The highest peak of the training phases since training started (evaluations, which the
    /// plan does not cover, left out); `None` before.
    training_peak: Option<u64>,
    started: std::time::Instant,
}

impl Ledger {
    /// A ledger measuring `device`. Starts a fresh peak window.
    pub fn new(device: &Device) -> Self {
        let _ = measure::read(device);
        Ledger {
            device: device.clone(),
            told: BTreeMap::new(),
            host: BTreeMap::new(),
            baseline: None,
            points: Vec::new(),
            timeline: None,
            predicted: None,
            unplanned: None,
            training_peak: None,
            started: std::time::Instant::now(),
        }
    }

    /// Also writes each profile point as one JSON line to `path` (created or truncated).
    pub fn with_timeline(mut self, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
        self.timeline = Some((path, std::io::BufWriter::new(file)));
        Ok(self)
    }

    /// True when the totals are real measurements (see [`measure::is_measured`]).
    pub fn is_measured(&self) -> bool {
        measure::is_measured(&self.device)
    }

    /// Records (or replaces) `bytes` under `name` in `category`, held in the measured memory.
    pub fn set(&mut self, category: Category, name: &str, bytes: u64) {
        self.set_on(category, name, bytes, &self.device.clone());
    }

    /// Records (or replaces) `bytes` under `name` in `category`, held on `device`. Host memory
    /// while the ledger measures a GPU is kept apart: subtracting it from the GPU's measured
    /// total would understate the activations by the offloaded gigabytes.
    pub fn set_on(&mut self, category: Category, name: &str, bytes: u64, device: &Device) {
        let (into, other) = if measures(&self.device, device) {
            (&mut self.told, &mut self.host)
        } else {
            (&mut self.host, &mut self.told)
        };
        if let Some(m) = other.get_mut(&category) {
            m.remove(name);
        }
        into.entry(category)
            .or_default()
            .insert(name.to_string(), bytes);
    }

    /// Records the bytes of `tensors` under `name` in `category`.
    pub fn set_tensors<'a>(
        &mut self,
        category: Category,
        name: &str,
        tensors: impl IntoIterator<Item = &'a Tensor>,
    ) {
        let bytes = tensors.into_iter().map(tensor_bytes).sum();
        self.set(category, name, bytes);
    }

    /// Forgets `name` in `category` (the memory was freed).
    pub fn remove(&mut self, category: Category, name: &str) {
        for map in [&mut self.told, &mut self.host] {
            if let Some(m) = map.get_mut(&category) {
                m.remove(name);
            }
        }
    }

    /// Told bytes of every category that live in host memory outside the measured GPU.
    pub fn host_by_category(&self) -> BTreeMap<Category, u64> {
        sums(&self.host)
    }

    /// Told bytes of one category.
    pub fn told(&self, category: Category) -> u64 {
        self.told
            .get(&category)
            .map(|m| m.values().sum())
            .unwrap_or(0)
    }

    /// Told bytes of every category in the measured memory.
    pub fn told_by_category(&self) -> BTreeMap<Category, u64> {
        sums(&self.told)
    }

    /// Makes the current measured bytes the zero from which later deltas count. On the CPU the
    /// matrix multiply's per-thread scratch is made first, so the baseline holds it
    /// ([`measure::warm_matmul_scratch`]).
    pub fn set_baseline(&mut self) -> Reading {
        if self.device.is_cpu() {
            measure::warm_matmul_scratch();
        }
        let r = measure::read(&self.device);
        self.baseline = Some(r.live);
        r
    }

    /// Records a profile point for `phase` at `step` and writes it to the timeline.
    pub fn mark(&mut self, phase: &str, step: u64) -> Result<&ProfilePoint> {
        let r = measure::read(&self.device);
        let point = ProfilePoint {
            phase: phase.to_string(),
            step,
            at: self.started.elapsed().as_secs_f64(),
            live: r.live,
            peak: r.peak,
            delta: self.baseline.map(|b| r.live as i64 - b as i64).unwrap_or(0),
            told: self.told_by_category(),
            host: self.host_by_category(),
        };
        if let Some(t) = self.training_peak.as_mut() {
            if !point.phase.starts_with("eval") {
                *t = (*t).max(point.peak);
            }
        }
        if let Some((path, w)) = self.timeline.as_mut() {
            let line = point_json(&point);
            writeln!(w, "{line}")
                .and_then(|_| w.flush())
                .map_err(|e| Error::io(path.clone(), e))?;
        }
        self.points.push(point);
        let last = self.points.len() - 1;
        Ok(&self.points[last])
    }

    /// Every profile point so far.
    pub fn points(&self) -> &[ProfilePoint] {
        &self.points
    }

    /// The peak the run's plan predicts on the device (model states, activations and backward's
    /// temporaries), reported beside the measured one.
    pub fn set_predicted_peak(&mut self, bytes: u64) {
        self.predicted = Some(bytes);
    }

    /// The predicted peak and the measured one it predicts: the highest peak of the training
    /// phases since training started (not loading, a cache build or evaluations, which the plan
    /// does not cover), above the baseline, less what the run held when training started besides
    /// the bytes it told (its data, tokenizer and the like) ([`Ledger::training_starts`]).
    /// `None` before training starts, and where the device's memory is not measured (no
    /// counting allocator, no pool).
    pub fn peak_against_plan(&self) -> Option<(u64, u64)> {
        if !self.is_measured() {
            return None;
        }
        let predicted = self.predicted?;
        Some((predicted, self.as_planned(self.training_peak?)?))
    }

    /// The last point's peak (the phase that just ended), counted as the plan counts:
    /// what `--fit`'s budget is watched against on the CPU. `None` where not measured.
    pub fn last_peak_as_planned(&self) -> Option<u64> {
        if !self.is_measured() {
            return None;
        }
        self.as_planned(self.points.last()?.peak)
    }

    /// A measured peak as the plan counts it: above the baseline, less what the run held
    /// before its first step besides the bytes it told.
    fn as_planned(&self, peak: u64) -> Option<u64> {
        let above = peak.saturating_sub(self.baseline.unwrap_or(0));
        Some(above.saturating_sub(self.unplanned?))
    }

    /// Takes the last point as the one before the first step: what the run holds there above
    /// the baseline besides the bytes it told (its data, cached latents, tokenizer and the like)
    /// is what the plan does not count. The run's first point would not do: sdxl-ft's is taken
    /// while its cache is being built, before the latents it trains on are held.
    /// From here on, the training phases' peaks are what [`Ledger::peak_against_plan`] compares.
    pub fn training_starts(&mut self) {
        self.unplanned = self.points.last().map(|p| {
            let told: u64 = p.told.values().sum();
            (p.delta.max(0) as u64).saturating_sub(told)
        });
        self.training_peak = Some(0);
    }

    /// Writes the memory timeline as a picture to `path` (see [`super::chart`]), with
    /// `--fit`'s budget when there is one and the plan's prediction.
    pub fn write_chart(&self, path: &Path, title: &str, budget: Option<u64>) -> Result<()> {
        let lines = super::chart::ChartLines {
            budget,
            predicted: self.predicted,
            unplanned: self.unplanned.unwrap_or(0),
            title: title.to_string(),
        };
        let svg = super::chart::svg(&self.points, &lines);
        ft_params::fs::write_atomic(path, |f| f.write_all(svg.as_bytes()))?;
        Ok(())
    }

    /// Highest measured peak over all points, with the phase it happened in.
    pub fn peak(&self) -> Option<(&str, u64)> {
        self.points
            .iter()
            .max_by_key(|p| p.peak)
            .map(|p| (p.phase.as_str(), p.peak))
    }

    /// Phases whose delta grew at each of their last `window` points (at least 2) by more than
    /// `tolerance` bytes in all: the pattern of seed 003's "OOM at the third evaluation". Looking
    /// only at the last points ignores one-off growth early in a run (optimizer state appears at
    /// the first step) and the ledger's own few hundred bytes per point.
    pub fn leak_suspects(&self, window: usize, tolerance: u64) -> Vec<LeakSuspect> {
        let window = window.max(2);
        let mut by_phase: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        for p in &self.points {
            by_phase.entry(&p.phase).or_default().push(p.delta);
        }
        let mut out = Vec::new();
        for (phase, deltas) in by_phase {
            if deltas.len() < window {
                continue;
            }
            let last = &deltas[deltas.len() - window..];
            let growing = last.windows(2).all(|w| w[1] > w[0]);
            let grew = last[last.len() - 1] - last[0];
            if growing && grew > tolerance as i64 {
                out.push(LeakSuspect {
                    phase: phase.to_string(),
                    first_delta: last[0],
                    last_delta: last[last.len() - 1],
                    occurrences: window,
                });
            }
        }
        out
    }
}

/// Whether memory on `on` is part of what a ledger of `measured` counts: the CPU's counting
/// allocator sees every host allocation; a GPU's pool sees only its own.
fn measures(measured: &Device, on: &Device) -> bool {
    measured.is_cpu() || !on.is_cpu()
}

/// Per-category totals of told bytes, without empty categories.
fn sums(told: &BTreeMap<Category, BTreeMap<String, u64>>) -> BTreeMap<Category, u64> {
    told.iter()
        .map(|(c, m)| (*c, m.values().sum::<u64>()))
        .filter(|(_, b)| *b > 0)
        .collect()
}

/// One profile point as a line of the timeline.
fn point_json(p: &ProfilePoint) -> String {
    let told: serde_json::Map<String, serde_json::Value> = p
        .told
        .iter()
        .map(|(c, b)| (c.as_str().to_string(), serde_json::Value::from(*b)))
        .collect();
    let host: serde_json::Map<String, serde_json::Value> = p
        .host
        .iter()
        .map(|(c, b)| (c.as_str().to_string(), serde_json::Value::from(*b)))
        .collect();
    serde_json::json!({
        "phase": p.phase,
        "step": p.step,
        "t_s": p.at,
        "live_bytes": p.live,
        "peak_bytes": p.peak,
        "delta_bytes": p.delta,
        "unaccounted_bytes": p.unaccounted(),
        "told": told,
        "host_told": host,
    })
    .to_string()
}
