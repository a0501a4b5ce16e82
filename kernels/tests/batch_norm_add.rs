//! Batch norm, a residual and the ReLU as one op (a ResNet block's end): values, statistics and
//! the gradients of the input, weight, bias and residual the separate ops' bit for bit (ReLU
//! zeros and sums of exactly zero included) in f32 and f64; finite differences; bad shapes one error; other
//! dtypes the separate ops.

mod common;
use candle_core::{DType, Result, Tensor, Var};
use common::*;
use ft_kernels::batch_norm_add::{batch_norm_add_relu_train, separate};

const BN_EPS: f64 = 1e-5;

/// These tests compare the op with the separate ops: under `FT_BN_ADD_OP=0` both sides would
/// be the separate ops, so they refuse to run there.
fn the_op_is_on() {
    assert!(
        std::env::var("FT_BN_ADD_OP").as_deref() != Ok("0"),
        "FT_BN_ADD_OP=0 turns off the op these tests check"
    );
}

/// An input of few distinct values (steps of 1/4), so that sums land on exactly zero.
fn coarse(shape: &[usize], seed: u64) -> Result<Tensor> {
    (rand(shape, seed)? * 4.0)?.round()? / 4.0
}

#[test]
fn values_statistics_and_gradients_are_the_separate_ops_bit_for_bit() -> Result<()> {
    the_op_is_on();
    let mut exact_zeros = 0.0;
    // The first has more planes than threads.
    for (i, shape) in [[16usize, 3, 5, 5], [3, 5, 7, 9], [2, 2, 1, 1]]
        .iter()
        .enumerate()
    {
        for dtype in [DType::F32, DType::F64] {
            let seed = 10 * i as u64;
            let var = |t: Tensor| Var::from_tensor(&t.to_dtype(dtype)?);
            let x = var(coarse(shape, seed)?)?;
            let r = var(coarse(shape, seed + 1)?)?;
            // Channel 0's weight is 0 and its bias -1/4: its normalised values are exactly
            // -1/4, so the sum with the quarter-step residual lands on zero (the ReLU's edge).
            let c = shape[1];
            let first = |v: f64, rest: Tensor| -> Result<Tensor> {
                Tensor::cat(&[&Tensor::new(&[v], rest.device())?, &rest], 0)
            };
            let w = first(0.0, (rand(&[c - 1], seed + 2)? + 1.5)?)?;
            let b = first(-0.25, (rand(&[c - 1], seed + 3)? * 0.5)?)?;
            let (w, b) = (var(w)?, var(b)?);
            let (ours, s) = batch_norm_add_relu_train(&x, &w, &b, BN_EPS, &r)?;
            let (want, t) = separate(&x, &w, &b, BN_EPS, &r)?;
            let case = format!("{shape:?} {dtype:?}");
            assert!(same_bits(&ours, &want)?, "{case}: values");
            assert_eq!(s, t, "{case}: statistics");
            assert!(zeros_in(&ours)? > 0.0, "{case}: the ReLU cut nothing");
            let sums = ((x.narrow(1, 0, 1)?.zeros_like()? - 0.25)? + r.narrow(1, 0, 1)?)?;
            exact_zeros += zeros_in(&sums)?;
            let probe = rand(shape, seed + 4)?.to_dtype(dtype)?;
            let grads = |y: &Tensor| probed_gradients(y, &probe, &[&x, &w, &b, &r]);
            let (g, h) = (grads(&ours)?, grads(&want)?);
            let names = ["x", "weight", "bias", "residual"];
            for (name, (a, b)) in names.iter().zip(g.iter().zip(&h)) {
                assert!(same_bits(a, b)?, "{case}: gradient of {name}");
            }
        }
    }
    assert!(exact_zeros > 0.0, "no sum of exactly zero");
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    the_op_is_on();
    let x = (rand(&[3, 2, 4, 3], 31)? * 2.0)?;
    let r = rand(&[3, 2, 4, 3], 32)?;
    let w = (rand(&[2], 33)? + 1.5)?;
    let b = (rand(&[2], 34)? * 0.5)?;
    check_gradients(
        |xs| Ok(batch_norm_add_relu_train(&xs[0], &xs[1], &xs[2], BN_EPS, &xs[3])?.0),
        &[x, w, b, r],
        EPS,
    )?
    .assert_close(1e-5)?;
    Ok(())
}

#[test]
fn bad_shapes_are_one_error_and_other_dtypes_take_the_separate_ops() -> Result<()> {
    the_op_is_on();
    let x = rand(&[2, 3, 4, 4], 41)?;
    let r = rand(&[2, 3, 4, 4], 42)?;
    let (w, b) = (rand(&[4], 43)?, rand(&[4], 44)?);
    let e = batch_norm_add_relu_train(&x, &w, &b, BN_EPS, &r).err();
    let e = e.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        e.contains("3 channels"),
        "a weight of 4 for 3 channels: {e}"
    );
    let (w, b) = (rand(&[3], 45)?, rand(&[3], 46)?);
    let short = rand(&[2, 3, 4, 3], 47)?;
    assert!(batch_norm_add_relu_train(&x, &w, &b, BN_EPS, &short).is_err());
    // bf16 on the CPU: the separate ops, the same values.
    let bf = |t: &Tensor| t.to_dtype(DType::BF16);
    let (ours, _) = batch_norm_add_relu_train(&bf(&x)?, &bf(&w)?, &bf(&b)?, BN_EPS, &bf(&r)?)?;
    let (want, _) = separate(&bf(&x)?, &bf(&w)?, &bf(&b)?, BN_EPS, &bf(&r)?)?;
    assert_eq!(ours.dtype(), DType::BF16);
    assert!(same_bits(&ours, &want)?);
    Ok(())
}
