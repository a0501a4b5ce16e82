//! Matmul and linear: the case candle computes wrongly (transposed lhs x broadcast rhs, batch > 1)
//! against a naive triple loop, and gradients against finite differences.

mod common;
use candle_core::{Device, Result, Tensor};
use common::*;
use ft_kernels::linear::{linear, matmul};

/// Naive [.., m, k] x [.., k, n] over equal batch dims, on flattened data.
fn naive(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (bs, m, k) = a.dims3()?;
    let n = b.dim(2)?;
    let av: Vec<f64> = a.flatten_all()?.to_vec1()?;
    let bv: Vec<f64> = b.flatten_all()?.to_vec1()?;
    let mut out = vec![0f64; bs * m * n];
    for z in 0..bs {
        for i in 0..m {
            for j in 0..n {
                out[(z * m + i) * n + j] = (0..k)
                    .map(|t| av[(z * m + i) * k + t] * bv[(z * k + t) * n + j])
                    .sum();
            }
        }
    }
    Tensor::from_vec(out, (bs, m, n), &Device::Cpu)
}

#[test]
fn transposed_lhs_times_broadcast_rhs_is_right() -> Result<()> {
    // lhs: a transposed view [3, 4, 5]; rhs: [5, 6] broadcast to [3, 5, 6] (stride 0).
    let a = random_non_contiguous(&[3, 4, 5], 1, &Device::Cpu)?;
    assert!(!a.is_contiguous());
    let b = rand(&[5, 6], 2)?;
    let got = matmul(&a, &b.unsqueeze(0)?)?;
    let want = naive(
        &a.contiguous()?,
        &b.unsqueeze(0)?.broadcast_as((3, 5, 6))?.contiguous()?,
    )?;
    assert!(max_diff(&got, &want)? < 1e-12);
    // linear on a non-contiguous 3-D input: what nn::Linear gets wrong.
    let w = rand(&[6, 5], 3)?;
    let bias = rand(&[6], 4)?;
    let x = rand(&[3, 5, 4], 5)?.transpose(1, 2)?; // [3, 4, 5]
    let got = linear(&x, &w, Some(&bias))?;
    let want = naive(
        &x.contiguous()?,
        &w.t()?.unsqueeze(0)?.broadcast_as((3, 5, 6))?.contiguous()?,
    )?
    .broadcast_add(&bias)?;
    assert!(max_diff(&got, &want)? < 1e-12);
    Ok(())
}

#[test]
fn four_d_non_contiguous_rhs_works() -> Result<()> {
    let a = rand(&[2, 3, 4, 5], 6)?;
    let b = rand(&[2, 3, 6, 5], 7)?.transpose(2, 3)?;
    let got = matmul(&a, &b)?;
    let want = naive(&a.reshape((6, 4, 5))?, &b.contiguous()?.reshape((6, 5, 6))?)?
        .reshape((2, 3, 4, 6))?;
    assert!(max_diff(&got, &want)? < 1e-12);
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    let (a, b) = (rand(&[2, 3, 5], 8)?, rand(&[5, 4], 9)?);
    check_gradients(
        |xs| matmul(&xs[0].transpose(1, 2)?.transpose(1, 2)?, &xs[1]),
        &[a.clone(), b],
        EPS,
    )?
    .assert_close(TOL)?;
    let (w, bias) = (rand(&[4, 3], 10)?, rand(&[4], 11)?);
    let x = rand(&[2, 3, 5], 12)?;
    check_gradients(
        |xs| linear(&xs[0].transpose(1, 2)?, &xs[1], Some(&xs[2])),
        &[x, w, bias],
        EPS,
    )?
    .assert_close(TOL)?;
    let _ = a;
    Ok(())
}
