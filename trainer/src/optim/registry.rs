//! What `--optim` can name: the [`OptimSpec`] each optimizer's file declares, listed once here.
//! Adding an optimizer is its file plus one line in [`REGISTRY`].

pub use super::spec::{OptimSettings, OptimSpec};
use crate::error::{Error, Result};

/// Every optimizer `--optim` can name.
pub const REGISTRY: &[&OptimSpec] = &[
    &super::adamw::SPEC,
    &super::adamw8bit::SPEC,
    &super::adafactor::SPEC,
    &super::sgd::SPEC,
];

/// The optimizer `name` names (case-insensitive, any of its names).
pub fn find(name: &str) -> Result<&'static OptimSpec> {
    let lower = name.to_ascii_lowercase();
    REGISTRY
        .iter()
        .copied()
        .find(|s| s.names.contains(&lower.as_str()))
        .ok_or_else(|| {
            let all: Vec<&str> = REGISTRY.iter().map(|s| s.name()).collect();
            Error::Invalid(format!("--optim `{lower}`: expected {}", all.join(", ")))
        })
}
