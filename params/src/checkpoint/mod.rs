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

mod segment;
mod sink;

pub use sink::{EarlyStep, GradSink};

use std::sync::Arc;

use candle_core::{Tensor, TensorId, Var};

use crate::error::Result;
use segment::SegmentOp;
use sink::locked;

/// A segment: a function of 1 to 3 tensors (hidden state, encoder output, bias, ...).
pub type SegmentFn = Arc<dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + Send + Sync>;

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
                return Err(crate::Error::Invalid(format!(
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
                return Err(crate::Error::Invalid(format!(
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
