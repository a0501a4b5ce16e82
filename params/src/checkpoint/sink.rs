//! Where a recomputed segment's parameter gradients go: summed per parameter for the end of the
//! backward, or handed to an early step (a fused backward pass) when they are final.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{Tensor, TensorId, Var};

/// Takes finished parameter gradients during backward (a fused backward pass: the optimizer
/// steps those parameters at once and the gradients are dropped): all of one segment's
/// parameters that no other segment uses, handed over together when its recomputation ends, so
/// that whatever the step reads back from the device (per-tensor clipping norms) it reads once
/// per segment. Returns the gradients it did not take, which go to the sink as usual.
pub type EarlyStep =
    Arc<dyn Fn(Vec<(Var, Tensor)>) -> candle_core::Result<Vec<(Var, Tensor)>> + Send + Sync>;

/// Parameter gradients produced while recomputing segments, summed per parameter; with an
/// early step installed, the gradients of parameters that only one segment uses go to it
/// instead (they are final when that segment's recomputation ends).
#[derive(Clone, Default)]
pub struct GradSink {
    pub(crate) grads: Arc<Mutex<HashMap<TensorId, Tensor>>>,
    /// Segments using each parameter in the current forward.
    pub(crate) uses: Arc<Mutex<HashMap<TensorId, usize>>>,
    pub(crate) early: Arc<Mutex<Option<EarlyStep>>>,
    /// Parameters the early step took in this backward.
    pub(crate) taken: Arc<Mutex<Vec<TensorId>>>,
}

pub(crate) fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl GradSink {
    /// A segment's finished parameter gradients: those of parameters this segment alone uses
    /// to the early step when one is installed, the rest (and those it leaves) summed in the
    /// sink.
    pub(crate) fn finish(&self, grads: Vec<(Var, Tensor)>) -> candle_core::Result<()> {
        let early = locked(&self.early).clone();
        let (exclusive, mut rest): (Vec<_>, Vec<_>) = match &early {
            Some(_) => {
                let uses = locked(&self.uses);
                grads
                    .into_iter()
                    .partition(|(p, _)| uses.get(&p.id()).copied() == Some(1))
            }
            None => (Vec::new(), grads),
        };
        if let (Some(step), false) = (early, exclusive.is_empty()) {
            let offered: Vec<TensorId> = exclusive.iter().map(|(p, _)| p.id()).collect();
            let left = step(exclusive)?;
            let kept: std::collections::HashSet<TensorId> =
                left.iter().map(|(p, _)| p.id()).collect();
            locked(&self.taken).extend(offered.into_iter().filter(|id| !kept.contains(id)));
            rest.extend(left);
        }
        for (p, g) in rest {
            self.add(p.id(), g)?;
        }
        Ok(())
    }

    fn add(&self, id: TensorId, g: Tensor) -> candle_core::Result<()> {
        let mut m = locked(&self.grads);
        if let Some(sum) = ft_kernels::grad_tap::sum(m.remove(&id), Some(g))? {
            m.insert(id, sum);
        }
        Ok(())
    }

    /// Removes and returns the gradient gathered for `id`.
    pub fn take(&self, id: TensorId) -> Option<Tensor> {
        locked(&self.grads).remove(&id)
    }

    /// Forgets everything gathered (e.g. after a step skipped on overflow), and the uses counted
    /// in the forward.
    pub fn clear(&self) {
        locked(&self.grads).clear();
        locked(&self.uses).clear();
    }
}
