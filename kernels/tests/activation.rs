//! GELU (tanh and erf), SiLU and ReLU: forward against candle's ops, backward against finite
//! differences, the threaded pass (above `host::CHUNK` elements) equal to the single one.

mod common;
use candle_core::{DType, Device, Result, Tensor};
use common::*;
use ft_kernels::activation::{activate, Activation};

const ALL: [Activation; 4] = [
    Activation::GeluTanh,
    Activation::GeluErf,
    Activation::Silu,
    Activation::Relu,
];

fn candle(x: &Tensor, a: Activation) -> Result<Tensor> {
    match a {
        Activation::GeluTanh => x.gelu(),
        Activation::GeluErf => x.gelu_erf(),
        Activation::Silu => x.silu(),
        Activation::Relu => x.relu(),
    }
}

#[test]
fn forward_matches_candle_in_every_float_dtype() -> Result<()> {
    let x = (rand(&[3, 7, 5], 1)? * 4.0)?;
    for a in ALL {
        assert!(
            max_diff(&activate(&x, a)?, &candle(&x, a)?)? < 1e-12,
            "{a:?} f64"
        );
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 2e-2), (DType::F16, 4e-3)] {
            let xd = x.to_dtype(dtype)?;
            let ours = activate(&xd, a)?;
            assert_eq!(ours.dtype(), dtype);
            let d = max_diff(
                &ours.to_dtype(DType::F64)?,
                &candle(&xd, a)?.to_dtype(DType::F64)?,
            )?;
            assert!(d < tol, "{a:?} {dtype:?}: {d}");
        }
    }
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    for a in ALL {
        let x = (rand(&[4, 9], 2)? * 3.0)?;
        check_gradients(|xs| activate(&xs[0], a), &[x], EPS)?.assert_close(TOL)?;
    }
    Ok(())
}

#[test]
fn non_contiguous_input_and_reuse_accumulate() -> Result<()> {
    for a in ALL {
        let x = rand(&[2, 5, 3], 3)?;
        check_gradients(
            |xs| activate(&xs[0].transpose(1, 2)?, a)? * &xs[0].transpose(1, 2)?,
            &[x],
            EPS,
        )?
        .assert_close(TOL)?;
        // A narrow view (GEGLU's gate half) starts inside its storage.
        let x = rand(&[3, 8], 5)?;
        check_gradients(|xs| activate(&xs[0].narrow(1, 4, 4)?, a), &[x], EPS)?.assert_close(TOL)?;
    }
    Ok(())
}

/// Gradients in f32 and bf16 agree with the f64 derivative to the dtype's rounding.
#[test]
fn low_precision_gradients_follow_the_f64_ones() -> Result<()> {
    let x = (rand(&[6, 11], 4)? * 3.0)?;
    for a in ALL {
        let exact = {
            let v = candle_core::Var::from_tensor(&x)?;
            activate(v.as_tensor(), a)?
                .sum_all()?
                .backward()?
                .get(v.as_tensor())
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?
        };
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 2e-2)] {
            let v = candle_core::Var::from_tensor(&x.to_dtype(dtype)?)?;
            let g = activate(v.as_tensor(), a)?
                .sum_all()?
                .backward()?
                .get(v.as_tensor())
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?;
            let d = max_diff(&g.to_dtype(DType::F64)?, &exact)?;
            assert!(d < tol, "{a:?} {dtype:?}: {d}");
        }
    }
    Ok(())
}

#[test]
fn long_tensors_take_the_threaded_pass_with_the_same_values() -> Result<()> {
    let n = ft_kernels::host::CHUNK * 2 + 17;
    let x = (Tensor::rand(-4f32, 4f32, n, &Device::Cpu)?).to_dtype(DType::F32)?;
    for a in ALL {
        let v = candle_core::Var::from_tensor(&x)?;
        let y = activate(v.as_tensor(), a)?;
        let g = y
            .sum_all()?
            .backward()?
            .get(v.as_tensor())
            .cloned()
            .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?;
        // Element by element the short pass gives the same bits.
        for at in [
            0,
            ft_kernels::host::CHUNK - 1,
            ft_kernels::host::CHUNK,
            n - 1,
        ] {
            let xi = x.narrow(0, at, 1)?;
            let vi = candle_core::Var::from_tensor(&xi)?;
            let yi = activate(vi.as_tensor(), a)?;
            let gi = yi.sum_all()?.backward()?.get(vi.as_tensor()).cloned();
            assert_eq!(
                y.narrow(0, at, 1)?.to_vec1::<f32>()?,
                yi.to_vec1::<f32>()?,
                "{a:?} at {at}"
            );
            assert_eq!(
                g.narrow(0, at, 1)?.to_vec1::<f32>()?,
                gi.map(|t| t.to_vec1::<f32>())
                    .transpose()?
                    .unwrap_or_default(),
                "{a:?} gradient at {at}"
            );
        }
    }
    Ok(())
}

/// Where the ReLU cut, an infinite or NaN gradient gives 0 (PyTorch's), not `g * 0`.
#[test]
fn relu_cuts_non_finite_gradients() -> Result<()> {
    let x = Tensor::new(&[-1.0f32, 2.0, -3.0, 0.0], &Device::Cpu)?;
    let v = candle_core::Var::from_tensor(&x)?;
    let y = activate(v.as_tensor(), Activation::Relu)?;
    let g = Tensor::new(&[f32::INFINITY, 1.5, f32::NAN, f32::NAN], &Device::Cpu)?;
    let grads = (y * g)?.sum_all()?.backward()?;
    let dx = grads
        .get(v.as_tensor())
        .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?;
    assert_eq!(dx.to_vec1::<f32>()?, [0.0, 1.5, 0.0, 0.0]);
    Ok(())
}
