//! Batch norm, ReLU, zero padding and max pooling as one op: values, statistics and the
//! gradients of the input, weight and bias the separate ops' bit for bit (ties and ReLU zeros
//! included), in f32 and f64, for Conv4's 2x2 pool, ResNet's padded 3x3/2 stem pool, an
//! overlapping pool and odd sizes; finite differences; bad shapes one error; other dtypes the
//! separate ops. (What its graph keeps is checked with the models' activation formulas.)

mod common;
use candle_core::{DType, Result, Tensor, Var};
use common::*;
use ft_kernels::batch_norm_pool::{
    affine_relu_max_pool, batch_norm_relu_max_pool_train, separate, MaxPool,
};

const BN_EPS: f64 = 1e-5;

/// These tests compare the op with the separate ops: under `FT_BN_POOL_OP=0` both sides would
/// be the separate ops, so they refuse to run there.
fn the_op_is_on() {
    assert!(
        std::env::var("FT_BN_POOL_OP").as_deref() != Ok("0"),
        "FT_BN_POOL_OP=0 turns off the op these tests check"
    );
}

/// A weight and bias of `c` channels: the weight away from 0, the bias below it (the ReLU
/// cuts about three values in four, so that windows of zeros are common).
fn affine(c: usize, seed: u64) -> Result<(Tensor, Tensor)> {
    Ok((
        (rand(&[c], seed)? + 1.5)?,
        ((rand(&[c], seed + 1)? * 0.3)? - 1.0)?,
    ))
}

/// An input of few distinct values (steps of 1/4): windows with equal maxima, the first of
/// which must take the gradient, as in the pool's op.
fn coarse(shape: &[usize], seed: u64) -> Result<Tensor> {
    ((rand(shape, seed)? * 4.0)?.round()? / 4.0)?.to_dtype(DType::F64)
}

/// The pools of the tests: Conv4's, ResNet's stem's, an overlapping one without padding, one
/// with more padding than its stride, the 2x2 path on a padded plane, a stride past the window.
fn pools() -> [MaxPool; 6] {
    [
        MaxPool::square(2, 2, 0),
        MaxPool::square(3, 2, 1),
        MaxPool::square(3, 1, 0),
        MaxPool::square(3, 3, 2),
        MaxPool::square(2, 2, 1),
        MaxPool::square(2, 3, 0),
    ]
}

#[test]
fn values_statistics_and_gradients_are_the_separate_ops_bit_for_bit() -> Result<()> {
    the_op_is_on();
    // The first has more planes than threads: a thread reuses its buffers across planes.
    let shapes = [[16usize, 3, 9, 9], [3, 5, 7, 9], [2, 2, 5, 5]];
    for (i, shape) in shapes.iter().enumerate() {
        for pool in pools() {
            for dtype in [DType::F32, DType::F64] {
                let seed = 10 * i as u64;
                let x = Var::from_tensor(&coarse(shape, seed)?.to_dtype(dtype)?)?;
                let (w, b) = affine(shape[1], seed + 1)?;
                let w = Var::from_tensor(&w.to_dtype(dtype)?)?;
                let b = Var::from_tensor(&b.to_dtype(dtype)?)?;
                let (ours, s) = batch_norm_relu_max_pool_train(&x, &w, &b, BN_EPS, pool)?;
                let (want, t) = separate(&x, &w, &b, BN_EPS, pool)?;
                let case = format!("{shape:?} {pool:?} {dtype:?}");
                assert!(same_bits(&ours, &want)?, "{case}: values");
                assert_eq!(s, t, "{case}: statistics");
                assert!(zeros_in(&ours)? > 0.0, "{case}: no window of zeros");
                let probe = rand(ours.dims(), seed + 2)?.to_dtype(dtype)?;
                let grads = |y: &Tensor| probed_gradients(y, &probe, &[&x, &w, &b]);
                let (g, h) = (grads(&ours)?, grads(&want)?);
                for (name, (a, b)) in ["x", "weight", "bias"].iter().zip(g.iter().zip(&h)) {
                    assert!(same_bits(a, b)?, "{case}: gradient of {name}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    the_op_is_on();
    // Smooth values (no ties: finite differences cannot cross a window's argmax).
    let x = (rand(&[3, 2, 6, 5], 31)? * 2.0)?;
    let (w, b) = affine(2, 32)?;
    for pool in pools() {
        check_gradients(
            |xs| Ok(batch_norm_relu_max_pool_train(&xs[0], &xs[1], &xs[2], BN_EPS, pool)?.0),
            &[x.clone(), w.clone(), b.clone()],
            EPS,
        )?
        .assert_close(1e-5)
        .map_err(|e| candle_core::Error::Msg(format!("{pool:?}: {e}")))?;
    }
    Ok(())
}

#[test]
fn a_strided_input_reads_right() -> Result<()> {
    the_op_is_on();
    let x = coarse(&[2, 3, 6, 8], 41)?;
    let (w, b) = affine(3, 42)?;
    let pool = MaxPool::square(2, 2, 0);
    let strided = x.transpose(2, 3)?;
    let (ours, _) = batch_norm_relu_max_pool_train(&strided, &w, &b, BN_EPS, pool)?;
    let (want, _) = separate(&strided.contiguous()?, &w, &b, BN_EPS, pool)?;
    assert!(same_bits(&ours, &want)?);
    Ok(())
}

#[test]
fn empty_inputs_give_the_separate_ops_shapes() -> Result<()> {
    the_op_is_on();
    let (w, b) = affine(3, 71)?;
    for (shape, pool) in [
        ([0usize, 3, 4, 4], MaxPool::square(2, 2, 0)),
        ([2, 3, 0, 4], MaxPool::square(3, 2, 2)),
    ] {
        let x = rand(&[shape.iter().product::<usize>().max(1)], 72)?
            .narrow(0, 0, shape.iter().product())?
            .reshape(&shape)?;
        let xv = Var::from_tensor(&x)?;
        let (ours, _) = batch_norm_relu_max_pool_train(&xv, &w, &b, BN_EPS, pool)?;
        let (want, _) = separate(&x, &w, &b, BN_EPS, pool)?;
        assert!(same_bits(&ours, &want)?, "{shape:?} {pool:?}");
        let grads = probed_gradients(&ours, &ours.ones_like()?, &[&xv])?;
        assert_eq!(grads[0].dims(), &shape);
    }
    Ok(())
}

#[test]
fn bad_shapes_are_one_error_and_other_dtypes_take_the_separate_ops() -> Result<()> {
    the_op_is_on();
    let x = rand(&[2, 3, 4, 4], 51)?;
    let (w, b) = affine(4, 52)?;
    let pool = MaxPool::square(2, 2, 0);
    let e = batch_norm_relu_max_pool_train(&x, &w, &b, BN_EPS, pool).err();
    let e = e.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        e.contains("3 channels"),
        "a weight of 4 for 3 channels: {e}"
    );
    let (w, b) = affine(3, 53)?;
    let e = batch_norm_relu_max_pool_train(&x, &w, &b, BN_EPS, MaxPool::square(7, 1, 1)).err();
    let e = e.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        e.contains("do not fit input 6x6"),
        "a 7x7 window on 6x6: {e}"
    );
    let flat = rand(&[2, 3, 16], 54)?;
    assert!(batch_norm_relu_max_pool_train(&flat, &w, &b, BN_EPS, pool).is_err());
    // bf16 on the CPU: the separate ops, the same values.
    let (xb, wb, bb) = (
        x.to_dtype(DType::BF16)?,
        w.to_dtype(DType::BF16)?,
        b.to_dtype(DType::BF16)?,
    );
    let (ours, _) = batch_norm_relu_max_pool_train(&xb, &wb, &bb, BN_EPS, pool)?;
    let (want, _) = separate(&xb, &wb, &bb, BN_EPS, pool)?;
    assert_eq!(ours.dtype(), DType::BF16);
    assert!(same_bits(&ours, &want)?);
    Ok(())
}

/// Evaluation's form: the running statistics' scale and shift, no graph, the values of the
/// separate ops (a broadcast multiply and add, the ReLU, the padding, the pool) bit for bit.
#[test]
fn evaluation_is_the_separate_ops_bit_for_bit_with_no_graph() -> Result<()> {
    the_op_is_on();
    for shape in [[16usize, 3, 9, 9], [3, 5, 7, 9]] {
        for pool in pools() {
            for dtype in [DType::F32, DType::F64] {
                let x = Var::from_tensor(&coarse(&shape, 61)?.to_dtype(dtype)?)?;
                let (scale, shift) = affine(shape[1], 62)?;
                let (scale, shift) = (scale.to_dtype(dtype)?, shift.to_dtype(dtype)?);
                let ours = affine_relu_max_pool(&x, &scale, &shift, pool)?;
                let s = (1, shape[1], 1, 1);
                let y = x
                    .broadcast_mul(&scale.reshape(s)?)?
                    .broadcast_add(&shift.reshape(s)?)?;
                let y = ft_kernels::activation::relu(&y)?;
                let y = y
                    .pad_with_zeros(2, pool.pad, pool.pad)?
                    .pad_with_zeros(3, pool.pad, pool.pad)?;
                let want = ft_kernels::pool::max_pool2d(&y, pool.kernel, pool.stride)?;
                let case = format!("{shape:?} {pool:?} {dtype:?}");
                assert!(same_bits(&ours, &want)?, "{case}");
                assert!(zeros_in(&ours)? > 0.0, "{case}: no window of zeros");
                assert!(!ours.track_op(), "{case}: a graph");
            }
        }
    }
    let x = rand(&[2, 3, 4, 4], 63)?;
    let e = affine_relu_max_pool(&x, &rand(&[2], 1)?, &rand(&[3], 2)?, pools()[0]).err();
    let e = e.map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("3 channels, scale of 2"), "{e}");
    Ok(())
}
