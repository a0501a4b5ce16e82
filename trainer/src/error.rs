//! The errors of training: every variant names the file, setting or step at fault. Loading a
//! model fails with `ft_params::Error`, carried as it is.

use std::path::PathBuf;

/// Errors of `ft-trainer`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {reason}")]
    Json { path: PathBuf, reason: String },
    #[error("model `{id}`: {reason}")]
    Hub { id: String, reason: String },
    #[error("config {path}: {reason}")]
    Config { path: String, reason: String },
    #[error("{0}")]
    Invalid(String),
    /// The loss or the gradients went non-finite for too many steps in a row.
    #[error("training diverged: {0}")]
    Diverged(String),
    /// The device ran out of memory in `phase` of `step` (counted from 1, as the progress bar
    /// counts; on the CPU: the `--fit` budget was passed, as the counting allocator measured
    /// it). The loop retries the step in smaller parts.
    #[error("out of memory in {phase} at step {step}: {detail}")]
    OutOfMemory {
        phase: String,
        step: u64,
        detail: String,
    },
    /// What a binary's [`crate::train::Task`] reported.
    #[error(transparent)]
    Task(Box<dyn std::error::Error + Send + Sync>),
    #[error(transparent)]
    Params(#[from] ft_params::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// Between the ranks of a data-parallel run: a launch this binary cannot join, ranks that
    /// disagree.
    #[error(transparent)]
    Dist(#[from] ft_dist::DistError),
}

/// Result of `ft-trainer`.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// True for [`Error::OutOfMemory`] and for a device's allocation failure however it arrives:
    /// candle's CUDA error directly, through the checkpointer's backward (`ft_params::Error`,
    /// where a GPU most often runs out), or a task's error carrying it. What the loop recovers
    /// from.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::OutOfMemory { .. } => true,
            Error::Candle(e) => says_out_of_memory(&e.to_string()),
            Error::Params(ft_params::Error::Candle(e)) => says_out_of_memory(&e.to_string()),
            Error::Task(e) => says_out_of_memory(&format!("{e}")),
            _ => false,
        }
    }

    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

/// Whether an error's text is an allocation failure: CUDA's `CUDA_ERROR_OUT_OF_MEMORY` (the
/// driver's, through cudarc) or its "out of memory" message.
fn says_out_of_memory(text: &str) -> bool {
    text.contains("CUDA_ERROR_OUT_OF_MEMORY") || text.to_lowercase().contains("out of memory")
}

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn a_cuda_allocation_failure_is_out_of_memory() {
        let cuda = || {
            candle_core::Error::Msg(
                "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
            )
        };
        assert!(Error::Candle(cuda()).is_out_of_memory());
        // From the checkpointer's backward (`self.checkpointer.gradients(..)?` in the loop).
        assert!(Error::from(ft_params::Error::from(cuda())).is_out_of_memory());
        let task: Box<dyn std::error::Error + Send + Sync> = "conv2d: out of memory".into();
        assert!(Error::Task(task).is_out_of_memory());
        let other = candle_core::Error::Msg("shape mismatch in matmul".into());
        assert!(!Error::Candle(other).is_out_of_memory());
        assert!(!Error::Invalid("no memory plan".into()).is_out_of_memory());
    }
}
