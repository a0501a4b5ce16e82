//! Load once: weights read tensor by tensor straight into the training dtype and device.
//!
//! The seed story 002 kept FLAN-T5-XL in memory two or three times (load in one dtype, convert,
//! move). Here a checkpoint is memory-mapped, and each tensor is decoded from the mapped bytes
//! directly into a buffer of the requested dtype, which becomes the model's tensor (a trainable
//! `Var` or a frozen tensor) without another copy on CPU. The largest transient is one tensor.

mod files;

pub use files::{shards_of_index, SafetensorsFiles, TensorMeta};
