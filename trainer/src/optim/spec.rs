//! One optimizer as the command line, the plan and the validation see it: each optimizer's file
//! declares its [`OptimSpec`], and [`super::registry`] lists them.

use super::Optimizer;

/// The settings an optimizer is built with from the command line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimSettings {
    /// `--weight-decay` (decoupled for AdamW and Adafactor, added to the gradient for SGD).
    pub weight_decay: f64,
}

/// One optimizer as the command line, the plan and the validation see it.
pub struct OptimSpec {
    /// The names `--optim` accepts; the first is the canonical one.
    pub names: &'static [&'static str],
    /// The plan's row of its state.
    pub state_label: &'static str,
    /// Bytes of its state for a trainable tensor of shape `dims`.
    pub state_bytes: fn(&[usize]) -> u64,
    /// Bytes its update of one fp32 tensor of shape `dims` allocates beyond the state it keeps,
    /// at most at once, where the update is host code or candle ops (the CPU, and a GPU without
    /// in-place kernels): the new values made before the old are freed, and the intermediates.
    /// The plan counts the largest tensor's at the moment its step runs (after backward, or
    /// inside a fused backward); `trainer/tests/step_temporaries.rs` measures them.
    pub step_bytes: fn(&[usize]) -> u64,
    /// Its CUDA kernels update the state and the weights in place, so that on a GPU its step
    /// allocates nothing the plan needs to count (not yet measured on a GPU).
    pub in_place_on_gpu: bool,
    /// Builds it over `n` parameters.
    pub build: fn(usize, &OptimSettings) -> Box<dyn Optimizer>,
    /// Its update on a GPU exists only as this crate's CUDA kernels: without them (a build
    /// without `cuda`, or `FT_CUDA_KERNELS=0`) its state must be offloaded to the host.
    pub gpu_needs_kernels: bool,
}

impl OptimSpec {
    /// The canonical name (`adamw`).
    pub fn name(&self) -> &'static str {
        self.names[0]
    }
}

impl std::fmt::Debug for OptimSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OptimSpec({})", self.name())
    }
}

impl PartialEq for OptimSpec {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}
