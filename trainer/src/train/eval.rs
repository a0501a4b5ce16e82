//! The best checkpoint by an evaluation metric, and early stopping.

use super::settings::BestConfig;

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
