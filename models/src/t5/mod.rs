//! A trainable T5 (original relu and v1.1/FLAN gated-gelu) with Hugging Face tensor names.

mod config;
mod model;
mod position;

pub use config::{FfAct, T5Config};
pub use model::{shift_right, summed_cross_entropy, T5Batch, T5};
pub use position::relative_position_bucket;
