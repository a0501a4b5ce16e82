//! The optimizer-side kernels against their formulas and the host: fused AdamW, the f16 unscale
//! with its overflow flag, sums of squares, stochastic rounding.

use candle_core::{DType, Device, Result, Tensor};
use ft_kernels::gradcheck::random_tensor;
use ft_kernels::rounding;

use super::common::{gpu, host};

/// The fused AdamW step against torch.optim.AdamW's formula in f64, for the first step (moments
/// ignored) and a later one, with a bf16 gradient and the bf16 model weight written in the same
/// pass (round to nearest of the new master).
#[test]
fn fused_adamw_matches_the_formula() -> Result<()> {
    use ft_kernels::cuda::{adamw_fused, AdamWStep};
    let Some(dev) = gpu() else { return Ok(()) };
    let n = 1000;
    let r = |seed: u64| -> Result<Tensor> {
        random_tensor(&[n], seed, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_device(&dev)
    };
    let master = r(50)?;
    let m = r(51)?;
    let v = r(52)?.abs()?;
    let grad = r(53)?.to_dtype(DType::BF16)?;
    let model = master.to_dtype(DType::BF16)?;
    for (t, first) in [(1, true), (7, false)] {
        let (p0, m0, v0, g0) = (host(&master)?, host(&m)?, host(&v)?, host(&grad)?);
        let (lr, b1, b2, eps, wd, gm) = (1e-3, 0.9, 0.999, 1e-8, 0.01, 0.5);
        let s = AdamWStep {
            lr,
            beta1: b1,
            beta2: b2,
            eps,
            weight_decay: wd,
            step_size: lr / (1.0 - f64::powi(b1, t)),
            bc2_sqrt: (1.0 - f64::powi(b2, t)).sqrt(),
            grad_mul: gm,
            first,
            seed: 0,
        };
        adamw_fused(&master, &m, &v, &grad, Some(&model), &s)?;
        let (p1, m1, v1, w1) = (host(&master)?, host(&m)?, host(&v)?, host(&model)?);
        for i in 0..n {
            let g = g0[i] * gm;
            let (mp, vp) = if first { (0.0, 0.0) } else { (m0[i], v0[i]) };
            let me = b1 * mp + (1.0 - b1) * g;
            let ve = b2 * vp + (1.0 - b2) * g * g;
            let pe = p0[i] * (1.0 - lr * wd) - s.step_size * me / (ve.sqrt() / s.bc2_sqrt + eps);
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
            assert!(close(m1[i], me), "exp_avg[{i}]: {} vs {me}", m1[i]);
            assert!(close(v1[i], ve), "exp_avg_sq[{i}]: {} vs {ve}", v1[i]);
            assert!(close(p1[i], pe), "master[{i}]: {} vs {pe}", p1[i]);
            let nearest = half::bf16::from_f64(p1[i]).to_f64();
            assert_eq!(w1[i], nearest, "bf16 weight[{i}] is not the rounded master");
        }
    }
    Ok(())
}

/// Unscale + inf check + cast in one pass: values divided, fp32 out, the flag set only when a
/// gradient holds inf or NaN.
#[test]
fn unscale_check_finds_overflow() -> Result<()> {
    use ft_kernels::cuda::unscale_check;
    let Some(dev) = gpu() else { return Ok(()) };
    let a = Tensor::new(&[2.0f32, -4.0, 8.0], &dev)?.to_dtype(DType::F16)?;
    let b = Tensor::new(&[[1.0f32, 3.0], [5.0, 7.0]], &dev)?.to_dtype(DType::BF16)?;
    let mut grads = vec![Some(a.clone()), None, Some(b.clone())];
    assert!(!unscale_check(&mut grads, 0.5)?);
    let g0 = grads[0].as_ref().map(host).transpose()?;
    assert_eq!(g0, Some(vec![1.0, -2.0, 4.0]));
    assert_eq!(grads[2].as_ref().map(|g| g.dtype()), Some(DType::F32));
    let bad = Tensor::new(&[1.0f32, f32::INFINITY], &dev)?;
    let mut grads = vec![Some(a), Some(bad)];
    assert!(unscale_check(&mut grads, 1.0)?);
    let nan = Tensor::new(&[f32::NAN], &dev)?.to_dtype(DType::BF16)?;
    assert!(unscale_check(&mut [Some(nan)], 1.0)?);
    Ok(())
}

/// The global-norm reduction: every gradient's squares in one f64 total.
#[test]
fn sum_squares_matches_the_host() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let a = random_tensor(&[100_003], 70, &Device::Cpu)?.to_dtype(DType::F32)?;
    let b = random_tensor(&[17, 5], 71, &Device::Cpu)?.to_dtype(DType::BF16)?;
    let want: f64 = [&a, &b]
        .iter()
        .map(|t| host(t).map(|v| v.iter().map(|x| x * x).sum::<f64>()))
        .sum::<Result<f64>>()?;
    let grads = [Some(a.to_device(&dev)?), None, Some(b.to_device(&dev)?)];
    let got = ft_kernels::cuda::sum_squares(&grads)?;
    assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
    // Each tensor's apart, one slot each (a strided f16 view among them): the per-tensor norms
    // of a fused backward pass's clipping.
    let c = random_tensor(&[40, 30], 72, &Device::Cpu)?
        .to_dtype(DType::F16)?
        .t()?;
    let each = [&a, &b, &c];
    let want: Vec<f64> = each
        .iter()
        .map(|t| host(t).map(|v| v.iter().map(|x| x * x).sum::<f64>()))
        .collect::<Result<_>>()?;
    let on_gpu: Vec<Tensor> = each
        .iter()
        .map(|t| t.to_device(&dev))
        .collect::<candle_core::Result<_>>()?;
    let got = ft_kernels::cuda::sum_squares_each(&on_gpu)?;
    assert_eq!(got.len(), 3);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-6 * w, "tensor {i}: {g} vs {w}");
    }
    Ok(())
}

/// Stochastic rounding on CUDA gives the CPU version's bits for the same seed.
#[test]
fn stochastic_rounding_matches_the_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let x = random_tensor(&[4097], 60, &Device::Cpu)?.to_dtype(DType::F32)?;
    let cpu = rounding::round_stochastic_bf16(&x, 1234)?;
    let gpu = rounding::round_stochastic_bf16(&x.to_device(&dev)?, 1234)?;
    let a: Vec<u16> = cpu
        .to_vec1::<half::bf16>()?
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let b: Vec<u16> = gpu
        .to_device(&Device::Cpu)?
        .to_vec1::<half::bf16>()?
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(a, b);
    Ok(())
}
