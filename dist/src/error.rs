//! What can go wrong between ranks.

/// An error of the distributed layer.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The launcher's environment is not what a launch gives (a rank that is not a number, a
    /// rank past the world size).
    #[error("launcher environment: {0}")]
    Launch(String),
    /// Several processes were launched, but this binary cannot talk to them.
    #[error("{0}")]
    Unsupported(String),
    /// The ranks disagree on something they must share (the configuration, the model).
    #[error("{0}")]
    Disagree(String),
    /// NCCL refused or failed a call (its library missing, a GPU it cannot reach).
    #[error("NCCL: {0}")]
    Nccl(String),
    /// A collective's buffers do not fit its world size.
    #[error("{0}")]
    Shape(String),
}

pub type Result<T> = std::result::Result<T, DistError>;
