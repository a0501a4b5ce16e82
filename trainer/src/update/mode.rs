//! How a step turns micro-batches into one update: decided and checked once, where the
//! configuration is read, so that nothing downstream checks it again.

use crate::error::{Error, Result};

/// How each optimizer step is taken.
///
/// Built only by [`StepMode::new`], which refuses combinations no run can satisfy: a value of
/// this type is a mode the loop and the update layer may follow without checking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepMode(Kind);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// One micro-batch: backward, then the update.
    Plain,
    /// Several micro-batches: each one's gradients summed (`GradAccumulator`), then one update.
    Accumulate(usize),
    /// Micro-batches whose backward hands each checkpointed segment's parameter gradients on as
    /// soon as that segment's backward ends, and drops them: into the step's sums
    /// (`MixedOptimizer::backward_and_accumulate`) for all but the last, into the update for the
    /// last (`MixedOptimizer::backward_and_step`).
    FusedBackward(usize),
}

/// What [`StepMode::new`] is decided from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepModeRequest {
    /// Micro-batches per step (`--accum`).
    pub micro_batches: usize,
    /// `--fused-backward`.
    pub fused_backward: bool,
    /// Whether the model runs as segments (`--checkpointing` other than none, or
    /// `--gradient-checkpointing`, on a model that has segments).
    pub checkpointing: bool,
    /// Whether the loss is scaled (f16).
    pub loss_scaling: bool,
}

impl StepMode {
    /// The mode a run asks for, or the one error that names what stands in its way.
    pub fn new(r: StepModeRequest) -> Result<Self> {
        let bad = |what: &str| Err(Error::Invalid(what.to_string()));
        if r.micro_batches == 0 {
            return bad("--accum must be at least 1");
        }
        if !r.fused_backward {
            return Ok(StepMode(match r.micro_batches {
                1 => Kind::Plain,
                n => Kind::Accumulate(n),
            }));
        }
        if !r.checkpointing {
            return bad(
                "--fused-backward updates each segment's parameters when that segment's \
                 backward ends: add --checkpointing blocks (nothing recomputed), full or \
                 --gradient-checkpointing (on a model that has checkpoint segments)",
            );
        }
        if r.loss_scaling {
            return bad("--fused-backward has no loss scaling: use bf16 or f32, not f16");
        }
        Ok(StepMode(Kind::FusedBackward(r.micro_batches)))
    }

    /// One plain micro-batch a step.
    pub fn plain() -> Self {
        StepMode(Kind::Plain)
    }

    /// Micro-batches per step.
    pub fn micro_batches(self) -> usize {
        match self.0 {
            Kind::Accumulate(n) | Kind::FusedBackward(n) => n,
            Kind::Plain => 1,
        }
    }

    /// Whether the backward hands gradients on segment by segment (into the sums, and on the
    /// step's last micro-batch into the update).
    pub fn fused_backward(self) -> bool {
        matches!(self.0, Kind::FusedBackward(_))
    }
}
