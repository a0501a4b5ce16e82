//! Learning-rate schedules with warmup, with the formulas of transformers' `get_*_schedule_with_warmup`.

use crate::error::{Error, Result};

/// The shape after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    Constant,
    Linear,
    Cosine,
}

impl std::str::FromStr for ScheduleKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "constant" => Ok(ScheduleKind::Constant),
            "linear" => Ok(ScheduleKind::Linear),
            "cosine" => Ok(ScheduleKind::Cosine),
            other => Err(Error::Invalid(format!(
                "unknown lr schedule `{other}` (expected constant, linear or cosine)"
            ))),
        }
    }
}

/// A learning-rate schedule over `total_steps` optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub kind: ScheduleKind,
    pub base_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl LrSchedule {
    /// Learning rate of the optimizer step taken after `step` earlier steps (0 for the first).
    ///
    /// As in transformers, warmup rises linearly from 0 (`step / warmup`), linear decays to 0 at
    /// `total_steps`, cosine follows half a cosine period to 0; constant stays at `base_lr`.
    pub fn lr_at(&self, step: u64) -> f64 {
        let s = step as f64;
        if step < self.warmup_steps {
            return self.base_lr * s / (self.warmup_steps.max(1) as f64);
        }
        let span = (self.total_steps.saturating_sub(self.warmup_steps)).max(1) as f64;
        let progress = (s - self.warmup_steps as f64) / span;
        let factor = match self.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Linear => (1.0 - progress).max(0.0),
            ScheduleKind::Cosine => {
                (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
            }
        };
        self.base_lr * factor
    }
}
