//! Errors of the models crate, each naming the file or setting at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config {path}: {reason}")]
    Config { path: String, reason: String },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Memory(#[from] ft_memory::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;
