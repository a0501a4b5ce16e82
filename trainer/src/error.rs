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
    /// What a binary's [`crate::train::Task`] reported.
    #[error(transparent)]
    Task(Box<dyn std::error::Error + Send + Sync>),
    #[error(transparent)]
    Params(#[from] ft_params::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result of `ft-trainer`.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
