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
    Params(#[from] ft_params::Error),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;

/// Reads a JSON config file into `T`; I/O and parse errors name the file.
pub fn read_config<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    serde_json::from_str(&text).map_err(|e| ModelError::Config {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}
