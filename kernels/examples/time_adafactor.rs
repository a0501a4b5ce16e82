//! Times the Adafactor kernels (`src/cuda/adafactor.cu`): one step of an fp32 master with
//! factored second moments writing the bf16 weight, at the SDXL UNet's shapes (a 1280 x 5120
//! feed-forward weight, a 1280 x 1280 x 3 x 3 convolution) and FLAN-T5-XL's (5120 x 2048). First
//! one step on a small matrix is checked against the update in f64 here (the CPU reference:
//! transformers' Adafactor as ft-trainer's `optim::adafactor` computes it).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_adafactor`

use candle_core::{DType, Device, Result, Tensor};
use ft_kernels::cuda::check::{gpu, report, time_us};
use ft_kernels::cuda::{adafactor_fused, AdafactorStep, SecondMoment};
use ft_kernels::gradcheck::random_tensor;

fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.to_device(&Device::Cpu)?
        .flatten_all()?
        .to_dtype(DType::F64)?
        .to_vec1()
}

/// One first step of a [rows, cols] matrix in f64: the new weights.
fn reference(w: &[f64], g: &[f64], rows: usize, cols: usize, s: &AdafactorStep) -> Vec<f64> {
    let sq: Vec<f64> = g.iter().map(|x| x * x + s.eps1).collect();
    let c2 = 1.0 - s.beta2t;
    let row: Vec<f64> = (0..rows)
        .map(|r| c2 * sq[r * cols..(r + 1) * cols].iter().sum::<f64>() / cols as f64)
        .collect();
    let col: Vec<f64> = (0..cols)
        .map(|c| c2 * (0..rows).map(|r| sq[r * cols + c]).sum::<f64>() / rows as f64)
        .collect();
    let rmean = row.iter().sum::<f64>() / rows as f64;
    let u: Vec<f64> = (0..rows * cols)
        .map(|i| g[i] / (row[i / cols] / rmean * col[i % cols]).sqrt())
        .collect();
    let rms = (u.iter().map(|x| x * x).sum::<f64>() / u.len() as f64).sqrt();
    let denom = (rms / s.clip_threshold).max(1.0);
    (0..rows * cols)
        .map(|i| w[i] * (1.0 - s.lr * s.weight_decay) - u[i] / denom * s.lr)
        .collect()
}

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let s = AdafactorStep {
        lr: 1e-3,
        eps1: 1e-30,
        beta2t: 1.0 - 1f64.powf(-0.8),
        clip_threshold: 1.0,
        weight_decay: 0.01,
        grad_mul: 1.0,
        seed: 0,
    };
    let r = |dims: &[usize], seed: u64| -> Result<Tensor> {
        random_tensor(dims, seed, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_device(&dev)
    };
    // The check: a 37 x 45 matrix, first step.
    let (rows, cols) = (37, 45);
    let (w, g) = (r(&[rows, cols], 1)?, r(&[rows, cols], 2)?);
    let want = reference(&host(&w)?, &host(&g)?, rows, cols, &s);
    let (row, col) = (
        Tensor::zeros(rows, DType::F32, &dev)?,
        Tensor::zeros(cols, DType::F32, &dev)?,
    );
    adafactor_fused(
        &w,
        &SecondMoment::Factored {
            row: &row,
            col: &col,
        },
        &g,
        None,
        &s,
    )?;
    for (i, (a, b)) in host(&w)?.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
            "weight[{i}]: {a} vs {b}"
        );
    }

    for dims in [vec![1280, 5120], vec![1280, 1280, 3, 3], vec![5120, 2048]] {
        let n: usize = dims.iter().product();
        let r_ = dims.len() - 1;
        let (b, rr, cc) = (
            dims[..r_ - 1].iter().product::<usize>(),
            dims[r_ - 1],
            dims[r_],
        );
        let (w, g) = (r(&dims, 3)?, r(&dims, 4)?.to_dtype(DType::BF16)?);
        let model = w.to_dtype(DType::BF16)?;
        let (row, col) = (
            Tensor::zeros(b * rr, DType::F32, &dev)?,
            Tensor::zeros(b * cc, DType::F32, &dev)?,
        );
        let v = SecondMoment::Factored {
            row: &row,
            col: &col,
        };
        let us = time_us(&dev, 20, || adafactor_fused(&w, &v, &g, Some(&model), &s))?;
        // The gradient is read three times (rows, columns, the update's RMS) and once more by
        // the update, which also reads and writes the master and writes the bf16 weight.
        report(&format!("adafactor {dims:?}"), us, Some(18 * n as u64));
    }
    Ok(())
}
