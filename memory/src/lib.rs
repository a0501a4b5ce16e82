//! The memory crate: what every trainer in this workspace shares to fit a model into memory and to
//! say where the bytes went.
//!
//! - [`ledger`] and [`alloc`]/[`measure`]: exact bytes by category plus measured totals at tagged
//!   profile points.
//! - [`weights`]: load once, straight into the training dtype and device.
//! - [`checkpoint`]: exact gradient checkpointing by segment recompute.
//! - [`precision`], [`mixed`], [`optim`], [`schedule`], [`accumulate`]: the update side;
//!   [`host`]: its threaded passes over host memory when the optimizer state is offloaded.
//! - [`train`]: the training loop the binaries share.
//! - [`config`]: a TOML config file with command-line overrides, shared by the binaries.

pub mod accumulate;
pub mod adafactor;
pub mod adamw8bit;
pub mod alloc;
pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod ema;
pub mod error;
pub mod fsutil;
pub mod host;
pub(crate) mod host_adamw;
pub mod ledger;
pub mod measure;
pub mod mixed;
pub mod optim;
pub mod plan;
pub mod precision;
pub mod rng;
pub mod schedule;
pub mod train;
pub mod weights;

pub use error::{Error, Result};
