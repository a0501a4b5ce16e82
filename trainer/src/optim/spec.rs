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
