//! The checker itself: it passes a correct backward and catches a wrong one.

mod common;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use common::*;

/// y = x^2 with a deliberately wrong backward (x instead of 2x).
struct WrongSquare;

impl CustomOp1 for WrongSquare {
    fn name(&self) -> &'static str {
        "wrong-square"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        match s {
            CpuStorage::F64(d) => {
                let (a, b) = l
                    .contiguous_offsets()
                    .ok_or_else(|| candle_core::Error::Msg("strided".into()))?;
                Ok((
                    CpuStorage::F64(d[a..b].iter().map(|x| x * x).collect()),
                    l.shape().clone(),
                ))
            }
            _ => candle_core::bail!("f64 only"),
        }
    }
    fn bwd(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some((g * arg)?))
    }
}

#[test]
fn a_correct_backward_passes() -> Result<()> {
    let x = rand(&[3, 5], 1)?;
    check_gradients(|xs| xs[0].sqr()?.exp(), &[x], EPS)?.assert_close(TOL)
}

#[test]
fn a_wrong_backward_is_caught() -> Result<()> {
    let x = rand(&[3, 5], 2)?;
    let r = check_gradients(|xs| xs[0].contiguous()?.apply_op1(WrongSquare), &[x], EPS)?;
    let err = r
        .assert_close(TOL)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("input 0"), "the checker must fail: {r:?}");
    Ok(())
}

#[test]
fn a_missing_gradient_is_caught() -> Result<()> {
    let x = rand(&[4], 3)?;
    // `detach` cuts the graph: the analytic gradient is zero where the numeric one is not.
    let r = check_gradients(|xs| xs[0].detach().sqr(), &[x], EPS)?;
    assert!(r.assert_close(TOL).is_err());
    Ok(())
}
