//! Exact gradient checkpointing: a segment keeps only its inputs in forward and is recomputed in
//! backward.
//!
//! candle keeps every activation alive until the loss is dropped and has no recompute hook. A
//! checkpointed segment is therefore run as one custom op: its forward evaluates the segment on
//! detached inputs and keeps only the output (the segment's graph is dropped at once); its
//! backward re-runs the segment on fresh `Var` copies of the inputs, backpropagates
//! `sum(output * grad_output)`, hands the input gradients back to candle's backprop and puts the
//! parameter gradients in a [`GradSink`]. The chain rule is unchanged, so the gradients equal
//! plain backprop (bit-identical on CPU f32 when no parameter is shared between segments).
//!
//! A segment function must be deterministic: dropout inside it has to take its mask from state
//! captured in the closure, or the recomputed forward differs from the first one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Storage, Tensor,
    TensorId, Var,
};

use crate::error::Result;

/// A segment: a function of 1 to 3 tensors (hidden state, encoder output, bias, ...).
pub type SegmentFn = Arc<dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + Send + Sync>;

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
    grads: Arc<Mutex<HashMap<TensorId, Tensor>>>,
    /// Segments using each parameter in the current forward.
    uses: Arc<Mutex<HashMap<TensorId, usize>>>,
    early: Arc<Mutex<Option<EarlyStep>>>,
    /// Parameters the early step took in this backward.
    taken: Arc<Mutex<Vec<TensorId>>>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl GradSink {
    /// A segment's finished parameter gradients: those of parameters this segment alone uses
    /// to the early step when one is installed, the rest (and those it leaves) summed in the
    /// sink.
    fn finish(&self, grads: Vec<(Var, Tensor)>) -> candle_core::Result<()> {
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
        let sum = match m.remove(&id) {
            Some(prev) => prev.add(&g)?,
            None => g,
        };
        m.insert(id, sum);
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

/// Runs segments checkpointed or plainly, and collects gradients from both paths.
#[derive(Clone, Default)]
pub struct Checkpointer {
    sink: GradSink,
    enabled: bool,
}

impl Checkpointer {
    pub fn new(enabled: bool) -> Self {
        Checkpointer {
            sink: GradSink::default(),
            enabled,
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Starts counting which segments use which parameters afresh: call before each forward
    /// whose backward may take early steps (an evaluation forward is never backpropagated, and
    /// its counts must not make every parameter look shared).
    pub fn begin_forward(&self) {
        locked(&self.sink.uses).clear();
    }

    /// Evaluates `f(inputs)` (1 to 3 inputs). When checkpointing is on, only the inputs and the
    /// output stay alive; `params` are the trainable parameters `f` uses, whose gradients go to
    /// the sink when the segment is recomputed in backward.
    pub fn run(&self, f: SegmentFn, inputs: &[&Tensor], params: &[Var]) -> Result<Tensor> {
        if !self.enabled {
            let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
            return Ok(f(&owned)?);
        }
        let mut args: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        // An op whose inputs are all untracked would not be recorded, and its parameters would
        // get no gradient: make the first input a variable so backprop reaches the segment.
        if !args.iter().any(|a| a.track_op()) {
            if let Some(first) = args.first_mut() {
                *first = Var::from_tensor(first)?.into_inner();
            }
        }
        {
            // Once per segment, however often the list names a parameter.
            let ids: std::collections::HashSet<TensorId> = params.iter().map(|p| p.id()).collect();
            let mut uses = locked(&self.sink.uses);
            for id in ids {
                *uses.entry(id).or_default() += 1;
            }
        }
        let op = SegmentOp {
            f,
            inputs: args.iter().map(|a| a.detach()).collect(),
            tracked: args.iter().map(|a| a.track_op()).collect(),
            params: params.to_vec(),
            sink: self.sink.clone(),
        };
        let out = match args.as_slice() {
            [a] => a.apply_op1(op)?,
            [a, b] => a.apply_op2(b, op)?,
            [a, b, c] => a.apply_op3(b, c, op)?,
            _ => {
                return Err(crate::error::Error::Invalid(format!(
                    "a checkpointed segment takes 1 to 3 inputs, got {}",
                    args.len()
                )))
            }
        };
        Ok(out)
    }

    /// Backpropagates `loss` and returns the gradient of each of `params` (None where the loss
    /// does not depend on it), adding what recomputed segments put in the sink.
    pub fn gradients(&self, loss: &Tensor, params: &[Var]) -> Result<Vec<Option<Tensor>>> {
        Ok(self.gradients_with(loss, params, None)?.0)
    }

    /// [`Self::gradients`] with `early` taking each parameter's gradient as soon as it is final
    /// (a fused backward pass, kohya's `--fused_backward_pass`): a parameter used by exactly one
    /// checkpointed segment, when that segment's recomputation ends. Returns the other
    /// parameters' gradients (None for those taken) and how many were taken. A parameter taken
    /// early that also gets a gradient from outside the segments is an error: its update came
    /// from part of its gradient, and backprop may have read its new value.
    pub fn gradients_with(
        &self,
        loss: &Tensor,
        params: &[Var],
        early: Option<EarlyStep>,
    ) -> Result<(Vec<Option<Tensor>>, usize)> {
        locked(&self.sink.taken).clear();
        *locked(&self.sink.early) = early;
        let result = self.collect(loss, params);
        *locked(&self.sink.early) = None;
        let taken: std::collections::HashSet<TensorId> =
            locked(&self.sink.taken).drain(..).collect();
        if result.is_err() {
            // A failed backward (or update) leaves nothing gathered for the next one.
            self.sink.clear();
        }
        let grads = result?;
        for (p, g) in params.iter().zip(&grads) {
            if g.is_some() && taken.contains(&p.id()) {
                return Err(crate::error::Error::Invalid(format!(
                    "a parameter of shape {:?} is used inside a checkpointed segment and outside \
                     it: a fused backward pass cannot update it early (turn --fused-backward off)",
                    p.dims()
                )));
            }
        }
        let grads = grads
            .into_iter()
            .zip(params)
            .map(|(g, p)| if taken.contains(&p.id()) { None } else { g })
            .collect();
        Ok((grads, taken.len()))
    }

    fn collect(&self, loss: &Tensor, params: &[Var]) -> Result<Vec<Option<Tensor>>> {
        let mut grads = loss.backward()?;
        let mut out = Vec::with_capacity(params.len());
        for p in params {
            let direct = grads.remove(p.as_tensor());
            let from_segments = self.sink.take(p.id());
            // Detached: a gradient computed from tracked activations records the ops that made
            // it, and would keep the whole forward graph alive for as long as it (or optimizer
            // state derived from it) lives.
            out.push(match (direct, from_segments) {
                (Some(a), Some(b)) => Some(a.add(&b)?.detach()),
                (a, b) => a.or(b).map(|g| g.detach()),
            });
        }
        self.sink.clear();
        Ok(out)
    }
}

struct SegmentOp {
    f: SegmentFn,
    inputs: Vec<Tensor>,
    tracked: Vec<bool>,
    params: Vec<Var>,
    sink: GradSink,
}

impl SegmentOp {
    /// Forward on the detached inputs; the segment's graph dies with `y` when this returns.
    fn forward(&self) -> candle_core::Result<Tensor> {
        let y = (self.f)(&self.inputs)?;
        let exact = y.is_contiguous() && y.layout().start_offset() == 0;
        Ok(if exact { y } else { y.force_contiguous()? })
    }

    fn backward(&self, grad_out: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let vars = self
            .inputs
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let xs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = (self.f)(&xs)?;
        let surrogate = (y * grad_out.detach())?.sum_all()?;
        let mut grads = surrogate.backward()?;
        let finished = self
            .params
            .iter()
            .filter_map(|p| Some((p.clone(), grads.remove(p.as_tensor())?.detach())))
            .collect();
        self.sink.finish(finished)?;
        Ok(vars
            .iter()
            .zip(&self.tracked)
            .map(|(v, tracked)| {
                if *tracked {
                    grads.remove(v.as_tensor()).map(|g| g.detach())
                } else {
                    None
                }
            })
            .collect())
    }

    fn cpu_out(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = self.forward()?;
        let (storage, _) = y.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.clone(), y.shape().clone())),
            _ => candle_core::bail!("checkpointed segment: output is not on the CPU"),
        }
    }

    fn cuda_out(&self) -> candle_core::Result<(CudaStorage, Shape)> {
        let y = self.forward()?;
        let (storage, layout) = y.storage_and_layout();
        match storage.try_clone(layout)? {
            Storage::Cuda(s) => Ok((s, y.shape().clone())),
            _ => candle_core::bail!("checkpointed segment: output is not on a CUDA device"),
        }
    }
}

fn nth(v: &[Option<Tensor>], i: usize) -> Option<Tensor> {
    v.get(i).cloned().flatten()
}

impl CustomOp1 for SegmentOp {
    fn name(&self) -> &'static str {
        "checkpointed-segment"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu_out()
    }
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.cuda_out()
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(nth(&self.backward(g)?, 0))
    }
}

impl CustomOp2 for SegmentOp {
    fn name(&self) -> &'static str {
        "checkpointed-segment"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu_out()
    }
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.cuda_out()
    }
    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let v = self.backward(g)?;
        Ok((nth(&v, 0), nth(&v, 1)))
    }
}

impl CustomOp3 for SegmentOp {
    fn name(&self) -> &'static str {
        "checkpointed-segment"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu_out()
    }
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.cuda_out()
    }
    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let v = self.backward(g)?;
        Ok((nth(&v, 0), nth(&v, 1), nth(&v, 2)))
    }
}
