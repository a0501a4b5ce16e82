//! fewshot-ft as a library: data, episodes, task and run setup, so tests drive the code path the
//! binary runs.

pub mod cli;
pub mod data;
pub mod run;
pub mod task;
