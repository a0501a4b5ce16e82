//! The CUDA optimizer path (fused AdamW writing the bf16 weights, the 8-bit AdamW and Adafactor
//! kernels, fused f16 unscale) against the CPU path on the same parameters and gradients. Built
//! only with `--features cuda`; each test returns early, saying so, when no GPU can be opened (a
//! failure instead with `FT_REQUIRE_GPU=1`, as `scripts/gpu-bench.sh` runs them, so a broken
//! driver is no pass).
#![cfg(feature = "cuda")]

mod adafactor;
mod adamw;
mod common;
mod mixed;
