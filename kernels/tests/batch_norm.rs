//! Batch norm with batch statistics as one op: values, statistics and gradients against the
//! composition of candle ops and against finite differences; bad shapes and dtypes are one
//! error; the same with the ReLU fused in. (What its graph keeps is checked with the models'
//! activation formulas.)

mod common;
use candle_core::{DType, Result, Tensor, Var};
use common::*;
use ft_kernels::batch_norm::{batch_norm_relu_train, batch_norm_train, composed};

/// A weight and bias of `c` channels, away from 1 and 0.
fn affine(c: usize, seed: u64) -> Result<(Tensor, Tensor)> {
    Ok(((rand(&[c], seed)? + 1.5)?, rand(&[c], seed + 1)?))
}

#[test]
fn values_and_statistics_match_the_composition() -> Result<()> {
    for shape in [[4usize, 3, 5, 6], [1, 2, 1, 1], [3, 5, 2, 7]] {
        let x = ((rand(&shape, 1)? * 3.0)? + 0.7)?;
        let (w, b) = affine(shape[1], 2)?;
        let (ours, s) = batch_norm_train(&x, &w, &b, 1e-5)?;
        let (want, t) = composed(&x, &w, &b, 1e-5)?;
        assert!(max_diff(&ours, &want)? < 1e-12, "{shape:?}");
        for (a, b) in s.mean.iter().zip(&t.mean).chain(s.var.iter().zip(&t.var)) {
            assert!((a - b).abs() < 1e-12, "{shape:?}: {a} vs {b}");
        }
        // f32 computes in f64 and rounds once.
        let (w32, b32) = (w.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
        let (y32, _) = batch_norm_train(&x.to_dtype(DType::F32)?, &w32, &b32, 1e-5)?;
        assert_eq!(y32.dtype(), DType::F32);
        assert!(max_diff(&y32, &want)? < 2e-6, "{shape:?} f32");
    }
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    let x = (rand(&[3, 2, 4, 3], 3)? * 2.0)?;
    let (w, b) = affine(2, 4)?;
    // A weighted sum of the output, so that every element's gradient differs.
    let probe = rand(&[3, 2, 4, 3], 5)?;
    check_gradients(
        |xs| batch_norm_train(&xs[0], &xs[1], &xs[2], 1e-5)?.0 * &probe,
        &[x, w, b],
        EPS,
    )?
    .assert_close(1e-5)?;
    Ok(())
}

#[test]
fn gradients_match_the_composition_and_a_strided_input_reads_right() -> Result<()> {
    // The input transposed in its last two dims: the op reads a contiguous copy.
    let x = Var::from_tensor(&(rand(&[2, 3, 5, 4], 6)? * 2.0)?)?;
    let (w, b) = affine(3, 7)?;
    let (w, b) = (Var::from_tensor(&w)?, Var::from_tensor(&b)?);
    let probe = rand(&[2, 3, 4, 5], 8)?;
    let loss = |f: &dyn Fn(&Tensor) -> Result<Tensor>| -> Result<Vec<Tensor>> {
        let y = f(&x.as_tensor().transpose(2, 3)?)?;
        probed_gradients(&y, &probe, &[&x, &w, &b])
    };
    let ours = loss(&|x| Ok(batch_norm_train(x, &w, &b, 1e-5)?.0))?;
    let want = loss(&|x| Ok(composed(x, &w, &b, 1e-5)?.0))?;
    for (name, (a, b)) in ["x", "weight", "bias"].iter().zip(ours.iter().zip(&want)) {
        assert!(rel_diff(a, b)? < 1e-12, "{name}: {}", rel_diff(a, b)?);
    }
    Ok(())
}

#[test]
fn the_fused_relu_matches_batch_norm_then_relu() -> Result<()> {
    // Values: the op's max(y, 0) against the composition and candle's ReLU, in f64 and f32.
    for shape in [[4usize, 3, 5, 6], [3, 5, 2, 7]] {
        let x = ((rand(&shape, 21)? * 3.0)? + 0.7)?;
        let (w, b) = affine(shape[1], 22)?;
        let (ours, s) = batch_norm_relu_train(&x, &w, &b, 1e-5)?;
        let want = composed(&x, &w, &b, 1e-5)?.0.relu()?;
        assert!(max_diff(&ours, &want)? < 1e-12, "{shape:?}");
        assert_eq!(s, batch_norm_train(&x, &w, &b, 1e-5)?.1);
        assert!(zeros_in(&ours)? > 0.0, "{shape:?}: the ReLU cut nothing");
        let (w32, b32) = (w.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
        let (y32, _) = batch_norm_relu_train(&x.to_dtype(DType::F32)?, &w32, &b32, 1e-5)?;
        assert!(max_diff(&y32, &want)? < 2e-6, "{shape:?} f32");
    }
    // Gradients: finite differences, and the composition's (the probe weighs every element).
    let x = (rand(&[3, 2, 4, 3], 23)? * 2.0)?;
    let (w, b) = affine(2, 24)?;
    let probe = rand(&[3, 2, 4, 3], 25)?;
    check_gradients(
        |xs| batch_norm_relu_train(&xs[0], &xs[1], &xs[2], 1e-5)?.0 * &probe,
        &[x.clone(), w.clone(), b.clone()],
        EPS,
    )?
    .assert_close(1e-5)?;
    let (xv, wv, bv) = (
        Var::from_tensor(&x)?,
        Var::from_tensor(&w)?,
        Var::from_tensor(&b)?,
    );
    let grads = |y: Tensor| probed_gradients(&y, &probe, &[&xv, &wv, &bv]);
    let ours = grads(batch_norm_relu_train(&xv, &wv, &bv, 1e-5)?.0)?;
    let want = grads(composed(&xv, &wv, &bv, 1e-5)?.0.relu()?)?;
    for (name, (a, b)) in ["x", "weight", "bias"].iter().zip(ours.iter().zip(&want)) {
        assert!(rel_diff(a, b)? < 1e-12, "{name}: {}", rel_diff(a, b)?);
    }
    Ok(())
}

#[test]
fn bad_shapes_and_dtypes_are_one_error() -> Result<()> {
    let x = rand(&[2, 3, 2, 2], 11)?;
    let (w, b) = affine(4, 12)?;
    let e = batch_norm_train(&x, &w, &b, 1e-5)
        .err()
        .map(|e| e.to_string());
    assert!(
        e.is_some_and(|e| e.contains("3 channels")),
        "a weight of 4 for 3 channels"
    );
    assert!(batch_norm_train(&rand(&[3], 1)?, &w, &b, 1e-5).is_err());
    // bf16 on the CPU takes the composition, with the same values to bf16's precision.
    let (w, b) = affine(3, 13)?;
    let xb = x.to_dtype(DType::BF16)?;
    let (wb, bb) = (w.to_dtype(DType::BF16)?, b.to_dtype(DType::BF16)?);
    let (y, _) = batch_norm_train(&xb, &wb, &bb, 1e-5)?;
    let (want, _) = composed(&x, &w, &b, 1e-5)?;
    assert!(max_diff(&y, &want)? < 5e-2);
    Ok(())
}
