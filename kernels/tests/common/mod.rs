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

/// The gradients of `sum(y * probe)` with respect to each of `of`, in order: a weighted sum,
/// so that every element's gradient differs.
pub fn probed_gradients(y: &Tensor, probe: &Tensor, of: &[&Tensor]) -> Result<Vec<Tensor>> {
    let g = (y * probe)?.sum_all()?.backward()?;
    of.iter()
        .map(|t| {
            g.get(t)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))
        })
        .collect()
}

/// How many elements of `t` are exactly zero (a ReLU's cut).
pub fn zeros_in(t: &Tensor) -> Result<f64> {
    t.eq(0.0)?
        .to_dtype(DType::F64)?
        .sum_all()?
        .to_scalar::<f64>()
}

/// Whether `a` and `b` hold the same bits (a zero's sign included), element by element.
pub fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    let bits = |t: &Tensor| -> Result<Vec<u64>> {
        let v: Vec<f64> = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
        Ok(v.iter().map(|x| x.to_bits()).collect())
    };
    Ok(a.dims() == b.dims() && bits(a)? == bits(b)?)
}
