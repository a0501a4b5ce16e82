//! Trainable models with Hugging Face tensor names, built from this workspace's ops (whose
//! backward is tested) rather than candle-transformers' inference code.

pub mod activations;
pub mod clip;
pub mod diffusion;
pub mod dropout;
pub mod error;
pub mod fewshot;
pub mod layers;
pub mod sampling;
pub mod t5;
pub mod unet;
pub mod vae;

pub use error::{ModelError, Result};
