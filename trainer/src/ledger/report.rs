//! The ledger as people read it: the end-of-run table.

use std::fmt::Write as _;

use candle_core::Device;
use ft_params::bytes::format_bytes;

use super::book::{Ledger, ProfilePoint};

impl Ledger {
    /// The end-of-run report: told bytes by category, then per phase the number of points, the
    /// highest live and peak bytes and the last delta from the baseline, then leak suspects.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "memory by component ({}):", device_name(&self.device));
        for (c, b) in self.told_by_category() {
            let _ = writeln!(s, "  {:<22} {:>12}", c.as_str(), format_bytes(b as i64));
        }
        if let Some(last) = self.points.last() {
            let _ = writeln!(
                s,
                "  {:<22} {:>12}   (measured minus told, at `{}`)",
                "activations & other",
                format_bytes(last.unaccounted()),
                last.phase
            );
        }
        let host = self.host_by_category();
        if !host.is_empty() {
            let _ = writeln!(
                s,
                "  on the host (not in the {} totals):",
                device_name(&self.device)
            );
            for (c, b) in host {
                let _ = writeln!(s, "  {:<22} {:>12}", c.as_str(), format_bytes(b as i64));
            }
        }
        if !self.is_measured() {
            let _ = writeln!(
                s,
                "  (totals not measured: counting allocator not installed)"
            );
        }
        let _ = writeln!(
            s,
            "{:<16} {:>6} {:>12} {:>12} {:>12}",
            "phase", "points", "max live", "max peak", "last delta"
        );
        let mut phases: Vec<&str> = Vec::new();
        for p in &self.points {
            if !phases.contains(&p.phase.as_str()) {
                phases.push(&p.phase);
            }
        }
        for phase in phases {
            let pts: Vec<&ProfilePoint> = self.points.iter().filter(|p| p.phase == phase).collect();
            let max_live = pts.iter().map(|p| p.live).max().unwrap_or(0);
            let max_peak = pts.iter().map(|p| p.peak).max().unwrap_or(0);
            let last = pts.last().map(|p| p.delta).unwrap_or(0);
            let _ = writeln!(
                s,
                "{:<16} {:>6} {:>12} {:>12} {:>12}",
                phase,
                pts.len(),
                format_bytes(max_live as i64),
                format_bytes(max_peak as i64),
                format_bytes(last)
            );
        }
        if let Some((phase, peak)) = self.peak() {
            let _ = writeln!(s, "peak {} during `{}`", format_bytes(peak as i64), phase);
        }
        if let Some((predicted, measured)) = self.peak_against_plan() {
            let _ = writeln!(
                s,
                "peak of the planned bytes (above the baseline and the data held before the \
                 first step) {}, the plan predicted {} ({:+.1}%)",
                format_bytes(measured as i64),
                format_bytes(predicted as i64),
                100.0 * (measured as f64 / predicted.max(1) as f64 - 1.0)
            );
        }
        for l in self.leak_suspects(3, 1 << 20) {
            let _ = writeln!(
                s,
                "possible leak: `{}` grew from {} to {} over {} points",
                l.phase,
                format_bytes(l.first_delta),
                format_bytes(l.last_delta),
                l.occurrences
            );
        }
        s
    }
}

fn device_name(d: &Device) -> &'static str {
    match d {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
        Device::Metal(_) => "metal",
    }
}
