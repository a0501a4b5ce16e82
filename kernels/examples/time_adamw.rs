//! Times the AdamW kernels (`src/cuda/adamw.cu`): one step of fp32 masters and moments writing
//! the bf16 model weight, and the 8-bit version, at tensor sizes of the SDXL UNet (its largest
//! weights hold about 13M values) and FLAN-T5-XL (its 65M-value embedding). First the fp32
//! kernel is checked against the update's formula in f64 here (the CPU reference), and the
//! 8-bit kernel's first step against the fp32 kernel's (their first steps are the same
//! arithmetic).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_adamw`

use candle_core::{DType, Device, Result, Tensor};
use ft_kernels::cuda::check::{gpu, report, time_us};
use ft_kernels::cuda::{adamw8bit_fused, adamw_fused, AdamWStep, Moments8bit};
use ft_kernels::gradcheck::random_tensor;

fn step(t: i32, first: bool) -> AdamWStep {
    let (lr, b1, b2) = (1e-4, 0.9, 0.999);
    AdamWStep {
        lr,
        beta1: b1,
        beta2: b2,
        eps: 1e-8,
        weight_decay: 0.01,
        step_size: lr / (1.0 - f64::powi(b1, t)),
        bc2_sqrt: (1.0 - f64::powi(b2, t)).sqrt(),
        grad_mul: 1.0,
        first,
        seed: 0,
    }
}

fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.to_vec1()
}

/// 8-bit moments of `n` values: zero codes, block maxima `max`.
fn moments8(n: usize, max: f64, dev: &Device) -> Result<[Tensor; 4]> {
    let blocks = n.div_ceil(256);
    Ok([
        Tensor::zeros(n, DType::U8, dev)?,
        Tensor::zeros(n, DType::U8, dev)?,
        (Tensor::ones(blocks, DType::F32, dev)? * max)?,
        (Tensor::ones(blocks, DType::F32, dev)? * max)?,
    ])
}

/// Any ascending 256-value map with 0 and 1 (the kernel's speed does not depend on its values).
fn maps(dev: &Device) -> Result<Tensor> {
    let signed = (0..256).map(|i| (i as f32 - 127.0) / 128.0);
    let unsigned = (0..256).map(|i| i as f32 / 255.0);
    Tensor::from_iter(signed.chain(unsigned), dev)
}

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let r = |n: usize, seed: u64| -> Result<Tensor> {
        random_tensor(&[n], seed, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_device(&dev)
    };
    // The check, on 4,096 values: the fp32 kernel against the formula.
    let n = 4096;
    let (master, m, v, grad) = (
        r(n, 1)?,
        r(n, 2)?,
        r(n, 3)?.abs()?,
        r(n, 4)?.to_dtype(DType::BF16)?,
    );
    let (p0, g0) = (host(&master)?, host(&grad)?);
    let s = step(1, true);
    adamw_fused(&master, &m, &v, &grad, None, &s)?;
    let p1 = host(&master)?;
    for i in 0..n {
        let (me, ve) = ((1.0 - s.beta1) * g0[i], (1.0 - s.beta2) * g0[i] * g0[i]);
        let pe = p0[i] * (1.0 - s.lr * s.weight_decay)
            - s.step_size * me / (ve.sqrt() / s.bc2_sqrt + s.eps);
        assert!(
            (p1[i] - pe).abs() <= 1e-5 * pe.abs().max(1e-3),
            "master[{i}]"
        );
    }
    // The 8-bit kernel's first step on the same inputs gives the same masters.
    let master8 = Tensor::from_vec(p0.iter().map(|x| *x as f32).collect(), n, &dev)?;
    let map = maps(&dev)?;
    let [mq, vq, mm, vm] = moments8(n, 0.0, &dev)?;
    let q = Moments8bit {
        m: &mq,
        v: &vq,
        m_max: &mm,
        v_max: &vm,
        maps: &map,
    };
    adamw8bit_fused(&master8, &q, &grad, None, &s)?;
    assert_eq!(
        host(&master8)?,
        p1,
        "8-bit first step differs from the fp32 kernel's"
    );

    for n in [1 << 20, 13_107_200, 65_798_144] {
        let (master, m, v) = (r(n, 1)?, r(n, 2)?, r(n, 3)?.abs()?);
        let grad = r(n, 4)?.to_dtype(DType::BF16)?;
        let model = master.to_dtype(DType::BF16)?;
        let s = step(10, false);
        let us = time_us(&dev, 20, || {
            adamw_fused(&master, &m, &v, &grad, Some(&model), &s)
        })?;
        // Reads master, m, v (4 bytes each) and the bf16 gradient; writes master, m, v and
        // the bf16 weight.
        report(
            &format!("adamw fp32 moments, {n} values"),
            us,
            Some(28 * n as u64),
        );
        let [mq, vq, mm, vm] = moments8(n, 1.0, &dev)?;
        let q = Moments8bit {
            m: &mq,
            v: &vq,
            m_max: &mm,
            v_max: &vm,
            maps: &map,
        };
        let us = time_us(&dev, 20, || {
            adamw8bit_fused(&master, &q, &grad, Some(&model), &s)
        })?;
        report(
            &format!("adamw 8-bit moments, {n} values"),
            us,
            Some(16 * n as u64),
        );
    }
    Ok(())
}
