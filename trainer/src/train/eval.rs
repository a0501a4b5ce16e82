//! The best checkpoint by an evaluation metric, and early stopping; their state travels in
//! checkpoints, so a resumed run judges its evaluations as an uninterrupted one would.

use super::settings::BestConfig;

/// The best value so far and the evaluations since it: what a checkpoint keeps of [`Best`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BestState {
    pub value: f64,
    pub bad_evals: usize,
}

impl BestState {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"value": self.value, "bad_evals": self.bad_evals})
    }

    /// What [`BestState::to_json`] wrote, or `None`.
    pub fn from_json(v: &serde_json::Value) -> Option<Self> {
        Some(BestState {
            value: v.get("value")?.as_f64()?,
            bad_evals: v.get("bad_evals")?.as_u64()? as usize,
        })
    }
}

/// Tracks the watched metric over a run's evaluations.
pub(super) struct Best {
    cfg: Option<BestConfig>,
    best: Option<f64>,
    bad_evals: usize,
}

impl Best {
    pub(super) fn new(cfg: Option<BestConfig>) -> Self {
        Best {
            cfg,
            best: None,
            bad_evals: 0,
        }
    }

    /// The watched metric's value when this evaluation beat every earlier one (the caller then
    /// saves the best checkpoint); counts an evaluation without improvement otherwise.
    pub(super) fn improved(&mut self, metrics: &[(String, f64)]) -> Option<f64> {
        let cfg = self.cfg.as_ref()?;
        let (_, v) = metrics.iter().find(|(k, _)| *k == cfg.metric)?;
        let better = match self.best {
            None => true,
            Some(best) if cfg.higher_is_better => *v > best,
            Some(best) => *v < best,
        };
        if better {
            self.best = Some(*v);
            self.bad_evals = 0;
            Some(*v)
        } else {
            self.bad_evals += 1;
            None
        }
    }

    /// Its state, for a checkpoint (`None` before the first evaluation of the watched metric).
    pub(super) fn state(&self) -> Option<BestState> {
        Some(BestState {
            value: self.best?,
            bad_evals: self.bad_evals,
        })
    }

    /// Continues from a checkpoint's state.
    pub(super) fn restore(&mut self, state: BestState) {
        self.best = Some(state.value);
        self.bad_evals = state.bad_evals;
    }

    /// Whether the run has waited its patience out.
    pub(super) fn should_stop(&self) -> bool {
        self.cfg
            .as_ref()
            .is_some_and(|c| c.patience > 0 && self.bad_evals >= c.patience)
    }

    /// Evaluations in a row without improvement.
    pub(super) fn bad_evals(&self) -> usize {
        self.bad_evals
    }
}
