//! f16 and bf16 forward of each op within a stated tolerance of f32 (relative to the f32
//! output's largest magnitude): bf16 2e-2, f16 2e-3. Every op here runs both dtypes on candle's
//! CPU backend (matmul included; candle's CPU conv2d lacks bf16, which no op here uses).

mod common;
use candle_core::{DType, Result, Tensor};
use common::*;
use ft_kernels::{attention, linear, norm, pool, softmax, upsample};

type Op = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;

fn ops() -> Result<Vec<(&'static str, Op, Vec<Tensor>)>> {
    let x = (rand(&[2, 4, 6, 8], 1)? * 3.0)?;
    let w = rand(&[8], 2)?;
    let b = rand(&[8], 3)?;
    let cw = rand(&[4], 4)?;
    let lw = rand(&[5, 8], 5)?;
    Ok(vec![
        (
            "softmax",
            Box::new(|t: &[Tensor]| softmax::softmax_last_dim(&t[0])),
            vec![x.clone()],
        ),
        (
            "log_softmax",
            Box::new(|t: &[Tensor]| softmax::log_softmax_last_dim(&t[0])),
            vec![x.clone()],
        ),
        (
            "layer_norm",
            Box::new(|t: &[Tensor]| norm::layer_norm(&t[0], Some(&t[1]), Some(&t[2]), 1e-5)),
            vec![x.clone(), w.clone(), b],
        ),
        (
            "rms_norm",
            Box::new(|t: &[Tensor]| norm::rms_norm(&t[0], Some(&t[1]), 1e-6)),
            vec![x.clone(), w],
        ),
        (
            "group_norm",
            Box::new(|t: &[Tensor]| norm::group_norm(&t[0], 2, Some(&t[1]), None, 1e-5)),
            vec![x.clone(), cw],
        ),
        (
            "linear",
            Box::new(|t: &[Tensor]| linear::linear(&t[0], &t[1], None)),
            vec![x.clone(), lw],
        ),
        (
            "upsample",
            Box::new(|t: &[Tensor]| upsample::upsample_nearest2x(&t[0])),
            vec![x.clone()],
        ),
        (
            "max_pool",
            Box::new(|t: &[Tensor]| pool::max_pool2d(&t[0], (3, 3), (2, 2))),
            vec![x.clone()],
        ),
        (
            "avg_pool",
            Box::new(|t: &[Tensor]| pool::avg_pool2d(&t[0], (2, 2), (2, 2))),
            vec![x.clone()],
        ),
        (
            "sdpa",
            Box::new(|t: &[Tensor]| attention::sdpa(&t[0], &t[0], &t[0], None, 0.3)),
            vec![x],
        ),
    ])
}

#[test]
fn f16_and_bf16_forwards_are_close_to_f32() -> Result<()> {
    for (name, f, inputs) in ops()? {
        let cast =
            |dt: DType| -> Result<Vec<Tensor>> { inputs.iter().map(|t| t.to_dtype(dt)).collect() };
        let reference = f(&cast(DType::F32)?)?;
        for (dt, tol) in [(DType::BF16, 2e-2), (DType::F16, 2e-3)] {
            // Inputs are rounded to dt first, so the reference sees the same values.
            let low_inputs = cast(dt)?;
            let reference_on_rounded = f(&low_inputs
                .iter()
                .map(|t| t.to_dtype(DType::F32))
                .collect::<Result<Vec<_>>>()?)?;
            let out = f(&low_inputs)?;
            assert_eq!(out.dtype(), dt, "{name} keeps the dtype");
            let e = rel_diff(&out, &reference_on_rounded)?;
            assert!(
                e < tol,
                "{name} in {dt:?}: relative error {e:.2e} > {tol:.0e}"
            );
            let _ = &reference;
        }
    }
    Ok(())
}
