//! The memory ledger: exact bytes by category for the tensors it is told about, measured totals
//! at tagged profile points, a table at the end of a run, a JSONL timeline, and leak suspicion.
//!
//! Told bytes (parameters, gradients, master weights, optimizer state, EMA) are exact because the
//! ledger computes them from shapes and dtypes. Everything else (activations, allocator slack,
//! data) is the measured total minus the told bytes, reported as "activations & other". A profile
//! point records both, so a run can say which phase peaked and which category grew.
//!
//! - [`alloc`]: the counting global allocator (exact heap bytes on the CPU).
//! - [`measure`]: one reading of a device (the allocator, or the CUDA memory pool).
//! - [`Ledger`] (`book`) and its table (`report`).
//! - [`chart`]: the timeline as a picture (`memory.svg`).

pub mod alloc;
pub mod block_cache;
mod book;
pub mod chart;
pub mod measure;
mod report;

pub use book::{LeakSuspect, Ledger, ProfilePoint};

/// What a block of bytes is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Category {
    Parameters,
    Gradients,
    MasterWeights,
    OptimizerState,
    Ema,
    Activations,
    Other,
}

impl Category {
    pub const ALL: [Category; 7] = [
        Category::Parameters,
        Category::Gradients,
        Category::MasterWeights,
        Category::OptimizerState,
        Category::Ema,
        Category::Activations,
        Category::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::MasterWeights => "master_weights",
            Category::OptimizerState => "optimizer_state",
            Category::Ema => "ema",
            Category::Activations => "activations",
            Category::Other => "other",
        }
    }
}
