//! The helpers of ft-params' tests, shared rather than copied (see that file's header).

#[path = "../../../params/tests/common/mod.rs"]
mod shared;
pub use shared::*;
