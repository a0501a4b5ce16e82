//! Nearest x2 upsampling: values, and a gradient that accumulates when the input has another
//! consumer (candle's own overwrites it).

mod common;
use candle_core::{DType, Device, Result, Tensor};
use common::*;
use ft_kernels::upsample::upsample_nearest2x;

#[test]
fn values_repeat_in_2x2_blocks() -> Result<()> {
    let x = Tensor::arange(0f64, 6., &Device::Cpu)?.reshape((1, 1, 2, 3))?;
    let y = upsample_nearest2x(&x)?;
    assert_eq!(y.dims(), &[1, 1, 4, 6]);
    let rows: Vec<Vec<f64>> = y.squeeze(0)?.squeeze(0)?.to_vec2()?;
    assert_eq!(rows[0], vec![0., 0., 1., 1., 2., 2.]);
    assert_eq!(rows[3], vec![3., 3., 4., 4., 5., 5.]);
    Ok(())
}

#[test]
fn gradient_accumulates_with_another_consumer() -> Result<()> {
    // A UNet skip: x feeds both an upsample and, through a pooling-like sum, the output.
    let x = rand(&[2, 3, 3, 5], 1)?;
    check_gradients(
        |xs| {
            let up = upsample_nearest2x(&xs[0])?.sqr()?;
            let down = up.reshape((2, 3, 3, 2, 5, 2))?.sum(5)?.sum(3)?;
            (down + (&xs[0] * 3.0)?)?.tanh()
        },
        std::slice::from_ref(&x),
        EPS,
    )?
    .assert_close(TOL)?;
    // Exact check: d/dx sum(up(x)) + sum(x) = 4 + 1 everywhere.
    let v = candle_core::Var::from_tensor(&x)?;
    let loss = (upsample_nearest2x(v.as_tensor())?.sum_all()? + v.as_tensor().sum_all()?)?;
    let g = loss.backward()?.get(v.as_tensor()).cloned().expect("grad");
    let ones = Tensor::ones(x.shape(), DType::F64, &Device::Cpu)?;
    assert_eq!(max_diff(&g, &(ones * 5.0)?)?, 0.0);
    Ok(())
}

#[test]
fn non_contiguous_input() -> Result<()> {
    let x = rand(&[1, 2, 5, 3], 2)?;
    check_gradients(|xs| upsample_nearest2x(&xs[0].transpose(2, 3)?), &[x], EPS)?.assert_close(TOL)
}
