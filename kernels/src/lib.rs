//! Ops with a backward that is checked against finite differences.
//!
//! candle 0.11.1 ships several ops whose gradient is missing or wrong (see
//! `shared/notes/candle-training.md`): the fast softmax and norms have no backward at all,
//! `upsample_nearest2d` overwrites instead of accumulating, pooling scales or errors. Training code
//! in this workspace uses the ops of this crate instead, each of which has a test against f64
//! central differences in `tests/`.

pub mod attention;
pub mod conv;
mod cpu;
pub mod gradcheck;
pub mod linear;
pub mod norm;
pub mod pool;
pub mod softmax;
pub mod upsample;
