//! sdxl-ft as a library: the diffusers pipeline loader, CLIP tokenizers, image data, the latent and
//! embedding cache, the task on the shared loop, sampling and the demo, so tests and benches drive
//! exactly the code path the binary runs.

pub mod cache;
pub mod cli;
pub mod data;
pub mod demo;
pub mod mmd;
pub mod pipeline;
pub mod run;
pub mod sample;
pub mod task;
pub mod tokenize;
