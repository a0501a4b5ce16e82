//! t5-ft as a library: its data layer, tokenization, task and run setup, so tests and benches
//! drive exactly the code path the binary runs.

pub mod cli;
pub mod data;
pub mod demo;
pub mod run;
pub mod task;
pub mod tokenize;
