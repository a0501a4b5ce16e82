//! Layer, RMS and group norm: forward against naive references, backward against finite differences.

mod common;
use candle_core::{Result, Tensor, D};
use common::*;
use ft_kernels::norm::{group_norm, layer_norm, rms_norm};

fn naive_layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let xc = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(w)?
        .broadcast_add(b)
}

fn naive_rms(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

#[test]
fn layer_norm_forward_and_gradients() -> Result<()> {
    let (x, w, b) = (rand(&[2, 3, 7], 1)?, rand(&[7], 2)?, rand(&[7], 3)?);
    assert!(
        max_diff(
            &layer_norm(&x, Some(&w), Some(&b), 1e-5)?,
            &naive_layer_norm(&x, &w, &b, 1e-5)?
        )? < 1e-12
    );
    check_gradients(
        |xs| layer_norm(&xs[0], Some(&xs[1]), Some(&xs[2]), 1e-5),
        &[x.clone(), w, b],
        EPS,
    )?
    .assert_close(TOL)?;
    // Non-contiguous input, no affine.
    check_gradients(
        |xs| layer_norm(&xs[0].transpose(0, 1)?, None, None, 1e-5),
        &[x],
        EPS,
    )?
    .assert_close(TOL)
}

#[test]
fn rms_norm_forward_and_gradients() -> Result<()> {
    let (x, w) = (rand(&[3, 2, 5], 4)?, rand(&[5], 5)?);
    assert!(max_diff(&rms_norm(&x, Some(&w), 1e-6)?, &naive_rms(&x, &w, 1e-6)?)? < 1e-12);
    check_gradients(
        |xs| rms_norm(&xs[0], Some(&xs[1]), 1e-6),
        &[x.clone(), w],
        EPS,
    )?
    .assert_close(TOL)?;
    check_gradients(
        |xs| rms_norm(&xs[0].transpose(1, 2)?, None, 1e-6),
        &[x],
        EPS,
    )?
    .assert_close(TOL)
}

#[test]
fn group_norm_forward_and_gradients() -> Result<()> {
    let (x, w, b) = (rand(&[2, 6, 3, 5], 6)?, rand(&[6], 7)?, rand(&[6], 8)?);
    // Reference: each (sample, group) normalised over its channels and pixels.
    let g = x.reshape((2, 3, 2 * 3 * 5))?;
    let ones = Tensor::ones(30, candle_core::DType::F64, x.device())?;
    let zeros = Tensor::zeros(30, candle_core::DType::F64, x.device())?;
    let want = naive_layer_norm(&g, &ones, &zeros, 1e-5)?
        .reshape((2, 6, 3, 5))?
        .broadcast_mul(&w.reshape((1, 6, 1, 1))?)?
        .broadcast_add(&b.reshape((1, 6, 1, 1))?)?;
    assert!(max_diff(&group_norm(&x, 3, Some(&w), Some(&b), 1e-5)?, &want)? < 1e-12);
    check_gradients(
        |xs| group_norm(&xs[0], 3, Some(&xs[1]), Some(&xs[2]), 1e-5),
        &[x, w, b],
        EPS,
    )?
    .assert_close(TOL)?;
    assert!(group_norm(&rand(&[1, 5, 2, 2], 1)?, 2, None, None, 1e-5).is_err());
    Ok(())
}
