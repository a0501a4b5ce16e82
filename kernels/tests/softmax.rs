//! Softmax and log-softmax: forward against a naive reference, backward against finite differences.

mod common;
use candle_core::{DType, Result, Tensor, D};
use common::*;
use ft_kernels::softmax::{log_softmax_last_dim, softmax_last_dim};

fn naive_softmax(x: &Tensor) -> Result<Tensor> {
    let e = x.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

#[test]
fn forward_matches_naive_on_odd_shapes() -> Result<()> {
    for shape in [vec![7], vec![3, 5], vec![2, 3, 9]] {
        let x = (rand(&shape, 1)? * 4.0)?;
        assert!(max_diff(&softmax_last_dim(&x)?, &naive_softmax(&x)?)? < 1e-12);
        assert!(max_diff(&log_softmax_last_dim(&x)?, &naive_softmax(&x)?.log()?)? < 1e-12);
    }
    // Large logits stay finite (max subtraction).
    let big = Tensor::new(&[1000f64, 1001., 999.], &candle_core::Device::Cpu)?;
    let y = softmax_last_dim(&big)?.to_vec1::<f64>()?;
    assert!(y.iter().all(|v| v.is_finite()));
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    for shape in [vec![2, 3, 5], vec![4, 7]] {
        let x = rand(&shape, 2)?;
        check_gradients(|xs| softmax_last_dim(&xs[0]), std::slice::from_ref(&x), EPS)?
            .assert_close(TOL)?;
        check_gradients(|xs| log_softmax_last_dim(&xs[0]), &[x], EPS)?.assert_close(TOL)?;
    }
    Ok(())
}

#[test]
fn non_contiguous_input() -> Result<()> {
    let x = rand(&[2, 5, 3], 3)?;
    check_gradients(
        |xs| softmax_last_dim(&xs[0].transpose(1, 2)?),
        std::slice::from_ref(&x),
        EPS,
    )?
    .assert_close(TOL)?;
    check_gradients(
        |xs| log_softmax_last_dim(&xs[0].transpose(1, 2)?),
        &[x],
        EPS,
    )?
    .assert_close(TOL)
}

#[test]
fn input_used_twice_accumulates() -> Result<()> {
    let x = rand(&[3, 4], 4)?;
    check_gradients(|xs| softmax_last_dim(&xs[0])? + &xs[0], &[x], EPS)?.assert_close(TOL)
}

/// Probabilities below f32's smallest normal value come out as 0 in f32 and bf16 (where they
/// would be subnormal numbers, slow to multiply on x86) and keep their value in f64; the rest
/// are the f64 softmax rounded once.
#[test]
fn tiny_probabilities_are_zero_below_f64() -> Result<()> {
    let x = Tensor::new(&[[0f64, -100., -90., -10.]], &candle_core::Device::Cpu)?;
    let want = naive_softmax(&x)?.flatten_all()?.to_vec1::<f64>()?;
    assert!(want[1] > 0.0 && want[2] > 0.0);
    for dt in [DType::F32, DType::BF16, DType::F64] {
        let y = softmax_last_dim(&x.to_dtype(dt)?)?;
        let y = y.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        for (j, (&a, &w)) in y.iter().zip(&want).enumerate() {
            if dt != DType::F64 && w < f32::MIN_POSITIVE as f64 {
                assert_eq!(a, 0.0, "{dt:?} element {j}");
            } else {
                let rounded = Tensor::new(&[w], x.device())?.to_dtype(dt)?;
                let rounded = rounded.to_dtype(DType::F64)?.to_vec1::<f64>()?[0];
                assert_eq!(a, rounded, "{dt:?} element {j}");
            }
        }
    }
    Ok(())
}
