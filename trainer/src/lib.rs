//! The training side of the workspace, by stage: what turns a model (`ft-models`, built on
//! `ft-params`) and data into a fine-tune that fits, and says where the bytes went.
//!
//! - [`optim`]: the optimizers' math and state, and the registry `--optim` names.
//! - [`update`]: the step between the loss and new weights: precision and fp32 masters, loss
//!   scaling, accumulation, clipping, the state on the host, the fused backward pass.
//! - [`ledger`]: exact bytes by component and phase (the counting allocator, device readings).
//! - [`train`]: the loop, the shared flags and config, the plan, schedules, EMA, data order.
//! - [`score`]: distribution metrics of generated samples (KID, CMMD), from host features.
//! - [`fault`]: failures made on purpose (`FT_FAULT`), for the tests of what one leaves behind.
//! - [`scratch`]: temporary paths removed when dropped, for tests.
//!
//! Modules depend downwards only: `train` on `update`, `optim` and `ledger`; `update` on
//! `optim` and `ledger`; `optim`, `ledger`, `score`, `fault` and `scratch` on nothing here.

pub mod error;
pub mod fault;
pub mod ledger;
pub mod optim;
pub mod score;
pub mod scratch;
pub mod train;
pub mod update;

pub use error::{Error, Result};
