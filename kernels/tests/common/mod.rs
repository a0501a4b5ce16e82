//! Shared by the op tests (included with `mod common;`).
#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor};
#[allow(unused_imports)]
pub use ft_kernels::gradcheck::{check_gradients, random_non_contiguous, random_tensor};

pub const EPS: f64 = 1e-5;
pub const TOL: f64 = 1e-6;

pub fn rand(shape: &[usize], seed: u64) -> Result<Tensor> {
    random_tensor(shape, seed, &Device::Cpu)
}

pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f64>()
}

/// Max |a - b| relative to max |b|.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let scale = b
        .to_dtype(DType::F64)?
        .abs()?
        .max_all()?
        .to_scalar::<f64>()?
        .max(1e-12);
    Ok(max_diff(a, b)? / scale)
}
