//! What a model needs to exist, and nothing of training: the crate `ft-models` builds on.
//!
//! - [`weights`]: safetensors files (memory-mapped, sharded) from a folder or the Hub, read
//!   tensor by tensor straight into the training dtype and device (load once).
//! - [`store`] and [`builder`]: a model's parameters under Hugging Face names, created from a
//!   checkpoint or a seeded initialiser; trainable ones are `Var`s.
//! - [`checkpoint`]: exact gradient checkpointing by segment recompute.
//! - [`rng`], [`fs`] (atomic saves), [`bytes`] (tensor byte counts) and [`error`].
//!
//! The training side (optimizers, the update step, the ledger, the loop and the command line)
//! lives in `ft-trainer`, above the models.

pub mod builder;
pub mod bytes;
pub mod checkpoint;
pub mod error;
pub mod fs;
pub mod rng;
pub mod store;
pub mod weights;

pub use builder::{Init, ParamBuilder};
pub use error::{Error, Result};
pub use store::{ParamStore, Segments};
