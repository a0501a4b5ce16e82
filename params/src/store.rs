//! A model's named parameters: its trainable `Var`s and frozen tensors in creation order, the
//! order optimizers and checkpoints use; and how they fall into checkpoint segments.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{Tensor, Var};

use crate::error::Result;

struct Entry {
    name: String,
    tensor: Tensor,
    trainable: bool,
}

/// Every parameter of a model, in creation order (the order optimizers and checkpoints use).
#[derive(Default)]
pub struct ParamStore {
    entries: Mutex<Vec<Entry>>,
}

impl ParamStore {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Entry>> {
        // A poisoned lock only means another thread panicked while pushing; the list is intact.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Trainable parameters as `Var`s (sharing storage with the model's tensors).
    pub fn trainable(&self) -> Result<Vec<(String, Var)>> {
        self.lock()
            .iter()
            .filter(|e| e.trainable)
            .map(|e| Ok((e.name.clone(), Var::from_tensor(&e.tensor)?)))
            .collect()
    }

    /// Frozen tensors.
    pub fn frozen(&self) -> Vec<(String, Tensor)> {
        self.lock()
            .iter()
            .filter(|e| !e.trainable)
            .map(|e| (e.name.clone(), e.tensor.clone()))
            .collect()
    }

    /// Every parameter, trainable or not.
    pub fn all(&self) -> Vec<(String, Tensor)> {
        self.lock()
            .iter()
            .map(|e| (e.name.clone(), e.tensor.clone()))
            .collect()
    }

    /// The parameter called `name`.
    pub fn get(&self, name: &str) -> Option<Tensor> {
        self.lock()
            .iter()
            .find(|e| e.name == name)
            .map(|e| e.tensor.clone())
    }

    /// Shapes of the trainable (or frozen) tensors, in order, without touching them (a
    /// shapes-only model has nothing to copy): what the memory plan counts from.
    pub fn shapes(&self, trainable: bool) -> Vec<Vec<usize>> {
        self.lock()
            .iter()
            .filter(|e| e.trainable == trainable)
            .map(|e| e.tensor.dims().to_vec())
            .collect()
    }

    /// Number of parameters (elements) and their bytes; `trainable` selects which.
    pub fn count(&self, trainable: bool) -> (usize, u64) {
        let g = self.lock();
        let it = g.iter().filter(|e| e.trainable == trainable);
        let n = it.clone().map(|e| e.tensor.elem_count()).sum();
        let b = it.map(|e| crate::bytes::tensor_bytes(&e.tensor)).sum();
        (n, b)
    }

    /// How the trainable parameters fall into the checkpoint segments a model lists (each
    /// segment's tensors, as the model hands them to `Checkpointer::run`; frozen ones are not
    /// counted): for the plan of a fused backward pass. A parameter in two segments counts as
    /// outside them all, as the fused backward keeps its gradient to the end. Works on a
    /// shapes-only model too.
    pub fn segments(&self, segments: &[Vec<Tensor>]) -> Segments {
        use std::collections::{HashMap, HashSet};
        // Trainable tensors in the store's order (the order of their shapes everywhere else).
        let entries: Vec<_> = self
            .lock()
            .iter()
            .filter(|e| e.trainable)
            .map(|e| (e.tensor.id(), e.tensor.dims().to_vec()))
            .collect();
        let dims: HashMap<_, &Vec<usize>> = entries.iter().map(|(id, d)| (*id, d)).collect();
        let sets: Vec<Vec<_>> = segments
            .iter()
            .map(|seg| {
                let mut seen = HashSet::new();
                seg.iter()
                    .map(|t| t.id())
                    .filter(|id| dims.contains_key(id) && seen.insert(*id))
                    .collect()
            })
            .collect();
        let mut uses: HashMap<_, usize> = HashMap::new();
        for id in sets.iter().flatten() {
            *uses.entry(*id).or_default() += 1;
        }
        let own = |id: &_| uses.get(id) == Some(&1);
        let size = |d: &Vec<usize>| d.iter().product::<usize>() as u64;
        let own_shapes: Vec<Vec<Vec<usize>>> = sets
            .iter()
            .map(|s| {
                s.iter()
                    .filter(|id| own(id))
                    .map(|id| dims[id].clone())
                    .collect()
            })
            .collect();
        let outside = entries
            .iter()
            .filter(|(id, _)| !own(id))
            .map(|(_, d)| d.clone())
            .collect();
        Segments {
            inside: own_shapes.iter().flatten().map(size).sum(),
            tensors: own_shapes.iter().map(Vec::len).sum(),
            largest: own_shapes
                .iter()
                .map(|s| s.iter().map(size).sum())
                .max()
                .unwrap_or(0),
            own: own_shapes,
            outside,
        }
    }

    pub(crate) fn insert(&self, name: String, tensor: Tensor, trainable: bool) {
        self.lock().push(Entry {
            name,
            tensor,
            trainable,
        });
    }
}

/// How a model's trainable parameters fall into checkpoint segments, in values: a fused
/// backward pass holds at once the gradients of the parameters outside every segment, or in
/// more than one (they wait for the end of the backward), and those of one segment (updated and
/// dropped as soon as its recomputation has produced them). [`ParamStore::segments`] counts them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Segments {
    /// Trainable values of parameters in exactly one segment.
    pub inside: u64,
    /// The most such values one segment holds.
    pub largest: u64,
    /// Trainable tensors in exactly one segment: those a fused backward pass updates early,
    /// which each step's `updated_in_backward` metric counts.
    pub tensors: usize,
    /// Each segment's own trainable tensors' shapes (those in no other segment), in the order
    /// the segments were listed: what its early step updates.
    pub own: Vec<Vec<Vec<usize>>>,
    /// The shapes of the trainable tensors in no segment or in more than one: what the step
    /// after the fused backward updates.
    pub outside: Vec<Vec<usize>>,
}

impl Segments {
    /// The gradients a backward forms, with `per_value` bytes per value: each segment's own
    /// tensors', then the rest's (what the plan's backward walk adds segment by segment).
    pub fn grad_bytes(&self, per_value: u64) -> crate::checkpoint::GradBytes {
        let bytes = |shapes: &[Vec<usize>]| -> u64 {
            let values: usize = shapes.iter().map(|d| d.iter().product::<usize>()).sum();
            per_value * values as u64
        };
        crate::checkpoint::GradBytes {
            segments: self.own.iter().map(|own| bytes(own)).collect(),
            outside: bytes(&self.outside),
        }
    }
}
