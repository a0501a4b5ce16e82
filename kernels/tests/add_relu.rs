//! `relu(a + b)` as one op: values against candle's `(a + b).relu()` (f64 and f32, a strided
//! operand), gradients against finite differences and the composition's, bad operands one error.

mod common;
use candle_core::{DType, Result, Tensor, Var};
use common::*;
use ft_kernels::add_relu::add_relu;

#[test]
fn values_match_the_sum_then_relu() -> Result<()> {
    for shape in [vec![3usize, 4, 5, 6], vec![7], vec![2, 70_000]] {
        let (a, b) = (rand(&shape, 1)?, rand(&shape, 2)?);
        let want = (&a + &b)?.relu()?;
        let ours = add_relu(&a, &b)?;
        assert_eq!(max_diff(&ours, &want)?, 0.0, "{shape:?}");
        assert!(zeros_in(&ours)? > 0.0, "{shape:?}: the ReLU cut nothing");
        let (a32, b32) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
        let y32 = add_relu(&a32, &b32)?;
        assert_eq!(y32.dtype(), DType::F32);
        assert!(max_diff(&y32, &want)? < 1e-6, "{shape:?} f32");
    }
    // A transposed operand is read as its values, not its storage.
    let (a, b) = (rand(&[4, 5], 3)?, rand(&[5, 4], 4)?.t()?);
    assert_eq!(max_diff(&add_relu(&a, &b)?, &(&a + &b)?.relu()?)?, 0.0);
    Ok(())
}

#[test]
fn gradients_match_finite_differences_and_the_composition() -> Result<()> {
    let shape = [2, 3, 4, 5];
    let (a, b) = (rand(&shape, 5)?, rand(&shape, 6)?);
    // A weighted sum, so that every element's gradient differs.
    let probe = rand(&shape, 7)?;
    check_gradients(
        |xs| add_relu(&xs[0], &xs[1])? * &probe,
        &[a.clone(), b.clone()],
        EPS,
    )?
    .assert_close(1e-6)?;
    let (av, bv) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
    let grads = |y: Tensor| probed_gradients(&y, &probe, &[&av, &bv]);
    let ours = grads(add_relu(&av, &bv)?)?;
    let want = grads((av.as_tensor() + bv.as_tensor())?.relu()?)?;
    for (a, b) in ours.iter().zip(&want) {
        assert_eq!(max_diff(a, b)?, 0.0);
    }
    Ok(())
}

#[test]
fn operands_of_other_shapes_or_dtypes_are_one_error() -> Result<()> {
    let a = rand(&[2, 3], 8)?;
    assert!(add_relu(&a, &rand(&[3, 2], 9)?).is_err());
    let e = add_relu(&a, &rand(&[2, 3], 9)?.to_dtype(DType::F32)?);
    assert!(e.is_err(), "f64 with f32");
    // bf16 takes candle's ops, with the same values to bf16's precision.
    let b = rand(&[2, 3], 10)?;
    let y = add_relu(&a.to_dtype(DType::BF16)?, &b.to_dtype(DType::BF16)?)?;
    assert!(max_diff(&y, &(&a + &b)?.relu()?)? < 2e-2);
    Ok(())
}
