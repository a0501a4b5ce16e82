//! The GPU check of every kernel family (one module each where the family has its own): the CUDA
//! path of every op the models use, against the CPU reference on fresh random inputs
//! (the kernels of `ft_kernels::cuda` included):
//! forward values and the gradient of a random weighting of the output, in f32 (within 1e-4
//! relative) and bf16 forwards (within 2e-2). Built only with `--features cuda`; each test
//! returns early, saying so, when no GPU can be opened (a CUDA build on a machine without one).
#![cfg(feature = "cuda")]

mod attention;
mod common;
mod ops;
mod optim;
