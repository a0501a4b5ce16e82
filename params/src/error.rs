//! The errors of loading and building a model: every variant names the file, tensor or setting at
//! fault, because "shape mismatch" without a name is useless in a 2,000-tensor checkpoint.

use std::path::PathBuf;

/// Errors of `ft-params`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a valid safetensors file: {reason}")]
    CorruptSafetensors { path: PathBuf, reason: String },
    #[error("{path}: invalid JSON: {reason}")]
    Json { path: PathBuf, reason: String },
    #[error("tensor `{name}` not found in {files}")]
    MissingTensor { name: String, files: String },
    #[error("{path}: tensor `{name}` has shape {actual:?}, the model expects {expected:?}")]
    WrongShape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("{path}: tensor `{name}` has dtype {dtype}, which cannot be loaded as a float weight")]
    UnsupportedDtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result of `ft-params`.
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
