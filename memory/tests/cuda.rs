//! The CUDA optimizer path (fused AdamW writing the bf16 weights, fused f16 unscale) against the
//! CPU path on the same parameters and gradients. Built only with `--features cuda`; each test
//! returns early, saying so, when no GPU can be opened.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor, Var};
use ft_kernels::gradcheck::random_tensor;
use ft_memory::mixed::MixedOptimizer;
use ft_memory::optim::{AdamW, AdamWConfig, Optimizer};
use ft_memory::precision::Precision;

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

fn host(t: &Tensor) -> anyhow::Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

/// Host copies of each parameter's values.
type Values = Vec<Vec<f32>>;

/// Three steps of MixedOptimizer (bf16 model, fp32 masters, AdamW) or f16 with loss scaling, on
/// the CPU and on CUDA: masters within f32 rounding, model weights their rounded masters.
fn mixed_parity(dtype: DType, dev: &Device) -> anyhow::Result<()> {
    let shapes: [&[usize]; 3] = [&[7, 5], &[300], &[2, 3, 4]];
    let run = |d: &Device| -> anyhow::Result<(Values, Values)> {
        let params: Vec<(String, Var)> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let t = random_tensor(s, i as u64, &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_device(d)?;
                Ok((format!("p{i}"), Var::from_tensor(&t)?))
            })
            .collect::<anyhow::Result<_>>()?;
        let mut opt = MixedOptimizer::new(
            params,
            Precision::for_dtype(dtype),
            |n| Box::new(AdamW::new(n, AdamWConfig::default())) as Box<dyn Optimizer>,
            Some(1.0),
        )?;
        for step in 0..3u64 {
            let scale = opt.loss_scale();
            let grads = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    // Parameter 1 gets no gradient on the second step.
                    if step == 1 && i == 1 {
                        return Ok(None);
                    }
                    // A quarter of the loss scale keeps f16 gradients below 65,504.
                    let g = (random_tensor(s, 100 + 10 * step + i as u64, &Device::Cpu)?
                        * (scale / 4.0))?;
                    Ok(Some(g.to_dtype(dtype)?.to_device(d)?))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            assert!(opt.step(grads, 1e-2)?.applied);
        }
        let masters = opt
            .masters()
            .iter()
            .map(|m| host(m.as_tensor()))
            .collect::<anyhow::Result<_>>()?;
        let model = opt
            .params()
            .iter()
            .map(|m| host(m.as_tensor()))
            .collect::<anyhow::Result<_>>()?;
        Ok((masters, model))
    };
    let (m_cpu, w_cpu) = run(&Device::Cpu)?;
    let (m_gpu, w_gpu) = run(dev)?;
    for (i, (a, b)) in m_gpu.iter().zip(&m_cpu).enumerate() {
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                "{dtype:?} master {i}: {x} vs {y}"
            );
        }
    }
    for (i, (a, b)) in w_gpu.iter().zip(&w_cpu).enumerate() {
        let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
        // A master within f32 rounding of a rounding boundary may round the other way.
        assert!(
            differ <= a.len() / 100 + 1,
            "{dtype:?} weights {i}: {differ} differ"
        );
    }
    eprintln!("{dtype:?}: CUDA optimizer path matches the CPU");
    Ok(())
}

#[test]
fn mixed_precision_step_matches_the_cpu() -> anyhow::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    mixed_parity(DType::BF16, &dev)?;
    mixed_parity(DType::F16, &dev)?;
    Ok(())
}

/// An f16 overflow on CUDA skips the step and backs the scale off, as on the CPU.
#[test]
fn overflow_skips_the_step_on_cuda() -> anyhow::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let w = Tensor::new(&[1.0f32, 2.0], &dev)?.to_dtype(DType::F16)?;
    let mut opt = MixedOptimizer::new(
        vec![("w".into(), Var::from_tensor(&w)?)],
        Precision::for_dtype(DType::F16),
        |n| Box::new(AdamW::new(n, AdamWConfig::default())) as Box<dyn Optimizer>,
        None,
    )?;
    let scale = opt.loss_scale();
    let g = Tensor::new(&[f32::INFINITY, 1.0], &dev)?.to_dtype(DType::F16)?;
    let out = opt.step(vec![Some(g)], 1e-2)?;
    assert!(!out.applied);
    assert_eq!(opt.loss_scale(), scale / 2.0);
    assert_eq!(host(opt.params()[0].as_tensor())?, vec![1.0, 2.0]);
    Ok(())
}
