//! The CUDA path of every op the models use, against the CPU reference on fresh random inputs:
//! forward values and the gradient of a random weighting of the output, in f32 (within 1e-4
//! relative) and bf16 forwards (within 2e-2). Built only with `--features cuda`; each test
//! returns early, saying so, when no GPU can be opened (a CUDA build on a machine without one).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Result, Tensor, Var};
use ft_kernels::gradcheck::random_tensor;
use ft_kernels::{attention, conv, linear, norm, softmax, upsample};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let d = (&a - &b)?.abs()?.max_all()?.to_scalar::<f64>()?;
    Ok(d / b.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-12))
}

/// Runs `f` on f32 copies of `inputs` on the CPU and on the GPU; compares outputs and the
/// gradients of `sum(w * f(inputs))` for every input.
fn compare(
    name: &str,
    dev: &Device,
    inputs: &[Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    let run = |d: &Device| -> Result<(Tensor, Vec<Tensor>)> {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.to_dtype(DType::F32)?.to_device(d)?))
            .collect::<Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts)?;
        let w = random_tensor(y.dims(), 0xBEEF, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_device(d)?;
        let grads = (&y * &w)?.sum_all()?.backward()?;
        let gs = vars
            .iter()
            .map(|v| {
                grads
                    .get(v.as_tensor())
                    .cloned()
                    .unwrap_or(v.as_tensor().zeros_like()?)
                    .to_device(&Device::Cpu)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((y.to_device(&Device::Cpu)?, gs))
    };
    let (y_cpu, g_cpu) = run(&Device::Cpu)?;
    let (y_gpu, g_gpu) = run(dev)?;
    let e = rel(&y_gpu, &y_cpu)?;
    assert!(
        e < 1e-4,
        "{name}: CUDA forward differs from the CPU by {e:.2e}"
    );
    for (i, (a, b)) in g_gpu.iter().zip(&g_cpu).enumerate() {
        let e = rel(a, b)?;
        assert!(e < 1e-4, "{name}: gradient of input {i} differs by {e:.2e}");
    }
    // bf16 forward within its precision of the f32 CPU result.
    let low: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::BF16)?.to_device(dev))
        .collect::<Result<_>>()?;
    let e = rel(&f(&low)?, &y_cpu)?;
    assert!(e < 2e-2, "{name}: bf16 CUDA forward differs by {e:.2e}");
    eprintln!("{name}: matches the CPU reference");
    Ok(())
}

#[test]
fn every_op_matches_its_cpu_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let r = |shape: &[usize], seed: u64| random_tensor(shape, seed, &Device::Cpu);
    compare("softmax", &dev, &[r(&[3, 5, 37], 1)?], |t| {
        softmax::softmax_last_dim(&t[0])
    })?;
    compare("log_softmax", &dev, &[r(&[3, 5, 37], 2)?], |t| {
        softmax::log_softmax_last_dim(&t[0])
    })?;
    compare(
        "layer_norm",
        &dev,
        &[r(&[2, 7, 48], 3)?, r(&[48], 4)?, r(&[48], 5)?],
        |t| norm::layer_norm(&t[0], Some(&t[1]), Some(&t[2]), 1e-5),
    )?;
    compare("rms_norm", &dev, &[r(&[2, 7, 48], 6)?, r(&[48], 7)?], |t| {
        norm::rms_norm(&t[0], Some(&t[1]), 1e-6)
    })?;
    compare(
        "group_norm",
        &dev,
        &[r(&[2, 16, 5, 6], 8)?, r(&[16], 9)?, r(&[16], 10)?],
        |t| norm::group_norm(&t[0], 4, Some(&t[1]), Some(&t[2]), 1e-5),
    )?;
    compare(
        "linear",
        &dev,
        &[r(&[2, 9, 24], 11)?, r(&[40, 24], 12)?, r(&[40], 13)?],
        |t| linear::linear(&t[0].transpose(0, 1)?, &t[1], Some(&t[2])),
    )?;
    compare("upsample_nearest2x", &dev, &[r(&[2, 3, 5, 7], 14)?], |t| {
        upsample::upsample_nearest2x(&t[0])
    })?;
    compare(
        "conv2d 3x3",
        &dev,
        &[r(&[2, 8, 9, 7], 15)?, r(&[12, 8, 3, 3], 16)?, r(&[12], 17)?],
        |t| conv::conv2d(&t[0], &t[1], Some(&t[2]), 1, 1),
    )?;
    compare(
        "conv2d stride 2",
        &dev,
        &[r(&[2, 8, 9, 7], 18)?, r(&[8, 8, 3, 3], 19)?],
        |t| conv::conv2d(&t[0], &t[1], None, 2, 1),
    )?;
    compare(
        "attention with bias",
        &dev,
        &[
            r(&[2, 4, 33, 16], 20)?,
            r(&[2, 4, 77, 16], 21)?,
            r(&[2, 4, 77, 16], 22)?,
            r(&[1, 4, 33, 77], 23)?,
        ],
        |t| attention::sdpa(&t[0], &t[1], &t[2], Some(&t[3]), 0.25),
    )?;
    Ok(())
}
