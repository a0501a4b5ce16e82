//! Exact gradient checkpointing: the model runs as segments cut from each other, and each
//! segment's graph is either kept until its own backward and freed there (`blocks`) or dropped
//! in forward and recomputed in backward (`full`); [`Strategy`] mixes the two.
//!
//! candle's `backward()` holds every node of the graph (and so every activation) until it
//! returns, and has no recompute hook. A segment is therefore run as one custom op whose
//! backward backpropagates the output's gradient (`seed.rs`: a scalar whose backward hands it
//! to the output) through the segment's own graph (kept, or rebuilt on fresh `Var` copies of
//! the inputs), hands the input gradients back to candle's backprop and puts the parameter
//! gradients (from candle's store and from `ft_kernels::grad_tap`, where this crate's ops hand
//! them) in a [`GradSink`]. When it returns, that graph is
//! gone: backward walks the segments in reverse and frees each as it goes. The chain rule is
//! unchanged, so the gradients equal plain backprop (bit-identical on CPU f32 when no parameter
//! is shared between segments).
//!
//! A recomputed segment function must be deterministic: dropout inside it has to take its mask
//! from state captured in the closure, or the recomputed forward differs from the first one.

mod profile;
mod seed;
mod segment;
mod sink;
mod strategy;

pub use profile::{ActivationProfile, GradBytes, Held, StepTemporaries, Temporaries};
pub use segment::{graph_bytes, graphs_bytes};
pub use sink::{EarlyStep, GradSink};
pub use strategy::{budget_keeps, Strategy};

use std::sync::{Arc, Mutex};

use candle_core::{Tensor, TensorId, Var};
use ft_kernels::grad_tap;

use crate::error::Result;
use segment::{Body, KeptGraph, SegmentOp};
use sink::locked;
use strategy::Treatment;

/// A segment: a function of 1 to 3 tensors (hidden state, encoder output, bias, ...).
pub type SegmentFn = Arc<dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + Send + Sync>;

/// Where the current forward is, and what the budget strategy has measured and chosen.
#[derive(Default)]
struct Progress {
    /// Index of the next segment in this forward.
    next: usize,
    /// Per segment, what it holds when kept (budget strategy, measured in the first step).
    sizes: Arc<Mutex<Vec<Option<u64>>>>,
    /// Per segment, whether the budget plan recomputes it.
    recompute: Option<Vec<bool>>,
    /// `full-host`: the host tensor behind each segment output handed to the model on the
    /// device, so that the next segment reads the host one (and the device one is not kept),
    /// and the host copy of each other input, made once however many segments read it.
    host_twins: std::collections::HashMap<TensorId, Tensor>,
    /// `full-host`: bytes of the tensors between segments held in host memory this forward.
    host_bytes: u64,
    /// When measuring ([`Checkpointer::measuring`]): what each segment kept in this forward.
    measured: Option<Vec<SegmentBytes>>,
}

/// What one segment kept from its forward (measured under `blocks`, or predicted by a model's
/// activation formulas): its graph's bytes ([`graph_bytes`], its output included), its
/// output's bytes, which the caller's graph holds as well, the copies of its inputs it
/// makes as its graph's leaves, and what its ops keep beside the graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentBytes {
    pub graph: u64,
    pub output: u64,
    /// A segment run as one op (kept or rebuilt) starts its graph at leaves of its own: a copy
    /// of each input whose gradient is needed (`Var::from_tensor` copies). Held as long as the
    /// graph is; without segments (`none`) there are none. T5's encoder blocks copy the
    /// per-example attention bias this way, one score tensor a block.
    pub inputs: u64,
    /// Backward's temporaries through ops whose share of them one factor of the graph
    /// ([`Temporaries`]) cannot follow, in bytes, on top of that factor's: the attention scores
    /// a block forms (growing with the sequence length squared, where the rest grows with it),
    /// the maps of its input's size a fused op forms in its backward but its graph does not
    /// keep (the batch norm's with the pooling after it). Set by a model's formulas; 0 when
    /// measured.
    pub op_temporaries: u64,
    /// What ops of the segment keep for their backward outside the graph's tensors, held as
    /// long as the graph is (the convolution's output inside `ft_kernels::conv::ConvBatchNorm`,
    /// which is no node of the graph, so that candle's backward forms no gradient slot for
    /// it). [`graph_bytes`] cannot see it: measured as what the segment's forward added to
    /// [`ft_kernels::op_kept`].
    pub op_kept: u64,
}

impl SegmentBytes {
    /// Everything the segment keeps until its backward, run as one op.
    pub fn kept(&self) -> u64 {
        self.graph + self.inputs + self.op_kept
    }

    /// What the segment's ops keep in a graph without segments (`none`): no leaf copies, and
    /// its output counted with the caller's graph.
    pub fn unsegmented(&self) -> u64 {
        self.graph.saturating_sub(self.output) + self.op_kept
    }
}

/// Runs segments as the strategy says, and collects gradients from all of them.
#[derive(Clone, Default)]
pub struct Checkpointer {
    sink: GradSink,
    strategy: Strategy,
    progress: Arc<Mutex<Progress>>,
    /// [`Self::inference`]: every segment runs on detached inputs and hands out a detached
    /// output.
    inference: bool,
}

impl Checkpointer {
    /// `enabled`: full recompute (`--gradient-checkpointing`); otherwise no segments.
    pub fn new(enabled: bool) -> Self {
        Self::with_strategy(if enabled {
            Strategy::Full
        } else {
            Strategy::None
        })
    }

    pub fn with_strategy(strategy: Strategy) -> Self {
        Checkpointer {
            strategy,
            ..Default::default()
        }
    }

    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// For a forward no gradient will go through (evaluation, sampling, generation): each
    /// segment runs on detached inputs and its output is detached, so a segment's graph (its
    /// ops reach the trainable weights, which are variables) is freed as soon as it returns,
    /// where a plain forward keeps every segment's until its result is dropped: the whole
    /// training graph of `none`, whatever the run's checkpointing. The same values as a plain
    /// forward.
    pub fn inference() -> Self {
        Checkpointer {
            inference: true,
            ..Default::default()
        }
    }

    /// `t` detached under [`Self::inference`], else `t`: for a model's ops between its
    /// segments, whose graphs (they reach trainable weights too) would otherwise stay with
    /// whatever keeps `t`, a skip connection say.
    pub fn cut(&self, t: Tensor) -> Tensor {
        if self.inference {
            t.detach()
        } else {
            t
        }
    }

    /// Whether this is [`Self::inference`]'s: a model may then take ops with no backward.
    pub fn is_inference(&self) -> bool {
        self.inference
    }

    /// Records what every kept segment holds from each forward on ([`Self::measured`]): the
    /// measurement that models' activation formulas are tested against, and that a probe step
    /// reads.
    pub fn measuring(self) -> Self {
        locked(&self.progress).measured = Some(Vec::new());
        self
    }

    /// Per segment kept in the current forward (in forward order), what it holds; empty unless
    /// [`Self::measuring`], and only segments the strategy keeps are listed (all of them under
    /// `blocks`).
    pub fn measured(&self) -> Vec<SegmentBytes> {
        locked(&self.progress).measured.clone().unwrap_or_default()
    }

    /// `true` when the model runs as segments (any strategy but `none`).
    pub fn enabled(&self) -> bool {
        self.strategy.segmented()
    }

    /// The budget strategy's plan once made (after the first backward): how many segments keep
    /// their graph, how many are recomputed, and the bytes the kept ones hold.
    pub fn budget_plan(&self) -> Option<(usize, usize, u64)> {
        let p = locked(&self.progress);
        let plan = p.recompute.as_ref()?;
        let sizes = locked(&p.sizes);
        let kept_bytes = plan
            .iter()
            .zip(sizes.iter())
            .filter(|(r, _)| !**r)
            .map(|(_, s)| s.unwrap_or(0))
            .sum();
        let recomputed = plan.iter().filter(|r| **r).count();
        Some((plan.len() - recomputed, recomputed, kept_bytes))
    }

    /// Starts counting which segments use which parameters afresh: call before each forward
    /// whose backward may take early steps (an evaluation forward is never backpropagated, and
    /// its counts must not make every parameter look shared).
    pub fn begin_forward(&self) {
        locked(&self.sink.uses).clear();
        let mut p = locked(&self.progress);
        p.next = 0;
        p.host_twins.clear();
        p.host_bytes = 0;
        if let Some(m) = &mut p.measured {
            m.clear();
        }
    }

    /// Bytes of the tensors between segments that `full-host` holds in host memory in the
    /// current forward (0 under every other strategy; back to 0 when the backward has run).
    pub fn host_bytes(&self) -> u64 {
        locked(&self.progress).host_bytes
    }

    /// `a` as the host-side input of a `full-host` segment: the host tensor behind a previous
    /// segment's output or made for an earlier segment, or a tracked copy in host memory (a distinct buffer on the CPU too,
    /// so that the path is exercised there).
    fn to_host(&self, a: &Tensor) -> Result<Tensor> {
        let mut p = locked(&self.progress);
        if let Some(t) = p.host_twins.get(&a.id()) {
            return Ok(t.clone());
        }
        let h = match (a.device().is_cpu(), a.track_op()) {
            (true, true) => a.copy()?,
            (true, false) => a.detach(),
            (false, _) => a.to_device(&candle_core::Device::Cpu)?,
        };
        p.host_bytes += crate::bytes::tensor_bytes(&h);
        // A tensor several segments read (T5's encoder output for every decoder block) is
        // copied once: its gradient sums on the host copy and flows back through one copy.
        p.host_twins.insert(a.id(), h.clone());
        Ok(h)
    }

    /// Evaluates `f(inputs)` (1 to 3 inputs). When checkpointing is on, only the inputs and the
    /// output stay alive; `params` are the trainable parameters `f` uses, whose gradients go to
    /// the sink when the segment is recomputed in backward.
    pub fn run(&self, f: SegmentFn, inputs: &[&Tensor], params: &[Var]) -> Result<Tensor> {
        if self.inference {
            let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
            return Ok(f(&detached)?.detach());
        }
        let (index, recompute, sizes) = {
            let mut p = locked(&self.progress);
            let index = p.next;
            p.next += 1;
            let measure = matches!(self.strategy, Strategy::Budget(_)) && p.recompute.is_none();
            (index, p.recompute.clone(), measure.then(|| p.sizes.clone()))
        };
        let treatment = self.strategy.treatment(index, recompute.as_deref());
        if treatment == Treatment::Plain {
            let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
            return Ok(f(&owned)?);
        }
        let mut args: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        let tracked: Vec<bool> = args.iter().map(|a| a.track_op()).collect();
        // An op whose inputs are all untracked would not be recorded, and its parameters would
        // get no gradient: make the first input a variable so backprop reaches the segment.
        if !tracked.iter().any(|t| *t) {
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
        let body = match treatment {
            Treatment::Keep => {
                let detached: Vec<Tensor> = args.iter().map(|a| a.detach()).collect();
                let (leaves, xs) = segment::leaves_for(&detached, &tracked)?;
                let op_kept = ft_kernels::op_kept::added();
                let y = f(&xs)?;
                if let Some(m) = &mut locked(&self.progress).measured {
                    m.push(SegmentBytes {
                        graph: graph_bytes(&y),
                        output: crate::bytes::tensor_bytes(&y),
                        inputs: segment::copies_bytes(&leaves),
                        op_kept: ft_kernels::op_kept::added() - op_kept,
                        ..SegmentBytes::default()
                    });
                }
                Body::Kept(Mutex::new(Some(KeptGraph { leaves, y })))
            }
            Treatment::RecomputeOnHost => {
                let device = args
                    .first()
                    .map(|a| a.device().clone())
                    .unwrap_or(candle_core::Device::Cpu);
                args = args
                    .iter()
                    .map(|a| self.to_host(a))
                    .collect::<Result<_>>()?;
                Body::Recompute {
                    f,
                    inputs: args.iter().map(|a| a.detach()).collect(),
                    sizes,
                    index,
                    device: Some(device),
                }
            }
            _ => Body::Recompute {
                f,
                inputs: args.iter().map(|a| a.detach()).collect(),
                sizes,
                index,
                device: None,
            },
        };
        let to_device = match &body {
            Body::Recompute {
                device: Some(d), ..
            } => Some(d.clone()),
            _ => None,
        };
        let op = SegmentOp {
            body,
            tracked: args.iter().map(|a| a.track_op()).collect(),
            copied: tracked,
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
        let Some(device) = to_device else {
            return Ok(out);
        };
        // The model gets the output on its device; the next segment will read the host one.
        let on_device = if device.is_cpu() {
            out.copy()?
        } else {
            out.to_device(&device)?
        };
        let mut p = locked(&self.progress);
        p.host_bytes += crate::bytes::tensor_bytes(&out);
        p.host_twins.insert(on_device.id(), out);
        Ok(on_device)
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
        self.end_backward();
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
                     it: its gradient cannot be handed on as the segment's backward ends (the \
                     fused backward's update, or the step's sums in segments; use \
                     --checkpointing none)",
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

    /// After a backward: the next forward starts at segment 0, and the budget strategy makes
    /// its plan once every segment of the first step has been measured.
    fn end_backward(&self) {
        let mut p = locked(&self.progress);
        let seen = std::mem::take(&mut p.next);
        p.host_twins.clear();
        p.host_bytes = 0;
        if let (Strategy::Budget(budget), None) = (self.strategy, &p.recompute) {
            let sizes = locked(&p.sizes).clone();
            if seen > 0 && sizes.len() == seen && sizes.iter().all(|s| s.is_some()) {
                let sizes: Vec<u64> = sizes.into_iter().flatten().collect();
                let keep = strategy::budget_keeps(&sizes, budget);
                p.recompute = Some(keep.iter().map(|k| !k).collect());
            }
        }
    }

    fn collect(&self, loss: &Tensor, params: &[Var]) -> Result<Vec<Option<Tensor>>> {
        // The ops hand the parameters' gradients over themselves (no zero-filled slot and add
        // per parameter in candle's store), segments' included.
        let _tap = grad_tap::open();
        let mut grads = loss.backward()?;
        let mut out = Vec::with_capacity(params.len());
        for p in params {
            let direct = grad_tap::remove(&mut grads, p.as_tensor())?;
            let from_segments = self.sink.take(p.id());
            // Detached: a gradient computed from tracked activations records the ops that made
            // it, and would keep the whole forward graph alive for as long as it (or optimizer
            // state derived from it) lives.
            out.push(grad_tap::sum(direct, from_segments)?.map(|g| g.detach()));
        }
        self.sink.clear();
        Ok(out)
    }
}
