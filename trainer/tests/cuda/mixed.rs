//! MixedOptimizer on CUDA against the CPU: masters, moments, loss scaling, the state placed on
//! the host or beside the model, restored state.

use candle_core::{DType, Device, Tensor, Var};
use ft_kernels::gradcheck::random_tensor;
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer};
use ft_trainer::update::{MixedOptimizer, Precision, StatePlacement};

use super::common::{close, gpu, host, optimizer, Run, Values};

/// Three steps of MixedOptimizer (bf16 model, fp32 masters, AdamW), f16 with loss scaling, or
/// an f32 model updated in place (no masters), on the CPU and on CUDA: masters and moments
/// within f32 rounding, model weights their rounded masters, the same global gradient norms
/// (which an unscale by the wrong factor would change; clipping at 1.0 would hide it in the
/// weights). The first gradient comes transposed (a strided view, as a linear weight's is).
/// With `StatePlacement::Host` the CUDA model's masters and moments live on the host and the
/// update runs there, from the gradients on the device: the same comparison holds.
fn mixed_parity(dtype: DType, dev: &Device, placement: StatePlacement) -> anyhow::Result<()> {
    eprintln!(
        "{dtype:?}: fused kernels {}",
        if ft_kernels::cuda::enabled() {
            "on"
        } else {
            "off (FT_CUDA_KERNELS=0)"
        }
    );
    let shapes: [&[usize]; 3] = [&[7, 5], &[300], &[2, 3, 4]];
    let run = |d: &Device, placement: StatePlacement| -> anyhow::Result<Run> {
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
        let mut opt = MixedOptimizer::adamw(
            params,
            Precision::for_dtype(dtype),
            placement,
            AdamWConfig::default(),
            Some(1.0),
        )?;
        let mut norms = Vec::new();
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
                    let g = g.to_dtype(dtype)?.to_device(d)?;
                    if i == 0 {
                        let t = g.t()?.contiguous()?.t()?;
                        assert!(!t.is_contiguous());
                        return Ok(Some(t));
                    }
                    Ok(Some(g))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let out = opt.step(grads, 1e-2)?;
            assert!(out.applied);
            norms.push(out.grad_norm.expect("clipping computes the norm"));
        }
        assert_eq!(opt.optimizer().state().0, 3);
        let all = |vs: &[Var]| -> anyhow::Result<Values> {
            vs.iter().map(|v| host(v.as_tensor())).collect()
        };
        let (_, moments) = opt.optimizer().state();
        Ok(Run {
            masters: all(opt.masters())?,
            model: all(opt.params())?,
            moments: moments
                .iter()
                .map(|(_, t)| host(t))
                .collect::<anyhow::Result<_>>()?,
            norms,
        })
    };
    let cpu = run(&Device::Cpu, StatePlacement::WithModel)?;
    let gpu = run(dev, placement)?;
    for (a, b) in gpu.norms.iter().zip(&cpu.norms) {
        assert!(
            (a - b).abs() <= 1e-5 * b,
            "{dtype:?} gradient norm {a} vs {b}"
        );
    }
    close("master", &gpu.masters, &cpu.masters, 1e-5);
    close("moment", &gpu.moments, &cpu.moments, 1e-5);
    if dtype == DType::F32 {
        // No masters beside an f32 model: the model weights are what AdamW updated (offloaded,
        // the host masters are, and the weights their copies).
        assert_eq!(
            gpu.masters.is_empty(),
            placement == StatePlacement::WithModel
        );
        close("weights", &gpu.model, &cpu.model, 1e-5);
    }
    for (i, (a, b)) in gpu.model.iter().zip(&cpu.model).enumerate() {
        let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
        // A master within f32 rounding of a rounding boundary may round the other way.
        assert!(
            dtype == DType::F32 || differ <= a.len() / 100 + 1,
            "{dtype:?} weights {i}: {differ} differ"
        );
    }
    eprintln!("{dtype:?} {placement:?}: CUDA optimizer path matches the CPU");
    Ok(())
}

#[test]
fn mixed_precision_step_matches_the_cpu() -> anyhow::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    for placement in [StatePlacement::WithModel, StatePlacement::Host] {
        mixed_parity(DType::BF16, &dev, placement)?;
        mixed_parity(DType::F16, &dev, placement)?;
        mixed_parity(DType::F32, &dev, placement)?;
    }
    Ok(())
}

/// Offloaded, a bf16 model's optimizer adds nothing to the GPU between steps (beside the model
/// it adds 12 bytes per parameter: fp32 master and two moments), and the ledger lists masters
/// and moments as host memory, outside the GPU's measured total.
#[test]
fn offloaded_state_leaves_the_gpu_and_the_ledger_says_so() -> anyhow::Result<()> {
    use ft_trainer::ledger::{measure, Category, Ledger};
    let Some(dev) = gpu() else { return Ok(()) };
    let n = 4 << 20;
    let added = |placement: StatePlacement| -> anyhow::Result<(u64, Ledger)> {
        let w = random_tensor(&[n], 1, &Device::Cpu)?.to_dtype(DType::BF16)?;
        let w = Var::from_tensor(&w.to_device(&dev)?)?;
        dev.synchronize()?;
        let before = measure::read(&dev).live;
        let mut opt = MixedOptimizer::adamw(
            vec![("w".into(), w)],
            Precision::parse("bf16")?,
            placement,
            AdamWConfig::default(),
            Some(1.0),
        )?;
        for step in 0..2 {
            let g = random_tensor(&[n], 10 + step, &Device::Cpu)?.to_dtype(DType::BF16)?;
            opt.step(vec![Some(g.to_device(&dev)?)], 1e-3)?;
        }
        dev.synchronize()?;
        let after = measure::read(&dev).live;
        let mut ledger = Ledger::new(&dev);
        opt.account(&mut ledger, "model");
        Ok((after.saturating_sub(before), ledger))
    };
    let (near, near_ledger) = added(StatePlacement::WithModel)?;
    let (host, host_ledger) = added(StatePlacement::Host)?;
    eprintln!("GPU bytes added by the optimizer: beside the model {near}, offloaded {host}");
    assert!(near >= 12 * n as u64, "beside the model: {near}");
    assert!(
        host < n as u64 / 8,
        "offloaded: {host} bytes stayed on the GPU"
    );
    assert_eq!(near_ledger.told(Category::MasterWeights), 4 * n as u64);
    assert_eq!(host_ledger.told(Category::MasterWeights), 0);
    assert_eq!(host_ledger.told(Category::OptimizerState), 0);
    let on_host = host_ledger.host_by_category();
    assert_eq!(on_host.get(&Category::MasterWeights), Some(&(4 * n as u64)));
    assert_eq!(
        on_host.get(&Category::OptimizerState),
        Some(&(8 * n as u64))
    );
    Ok(())
}

/// An f16 overflow on CUDA skips the step and backs the scale off, as on the CPU.
#[test]
fn overflow_skips_the_step_on_cuda() -> anyhow::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let w = Tensor::new(&[1.0f32, 2.0], &dev)?.to_dtype(DType::F16)?;
    let mut opt = MixedOptimizer::adamw(
        vec![("w".into(), Var::from_tensor(&w)?)],
        Precision::for_dtype(DType::F16),
        StatePlacement::WithModel,
        AdamWConfig::default(),
        None,
    )?;
    let scale = opt.loss_scale();
    let g = Tensor::new(&[f32::INFINITY, 1.0], &dev)?.to_dtype(DType::F16)?;
    let out = opt.step(vec![Some(g)], 1e-2)?;
    assert!(!out.applied);
    assert_eq!(opt.loss_scale(), scale / 2.0);
    assert_eq!(host(opt.params()[0].as_tensor())?, vec![1.0, 2.0]);
    // A skipped step is no step: AdamW's counter (its bias correction) has not moved.
    assert_eq!(opt.optimizer().state().0, 0);
    Ok(())
}

/// A state handed from one AdamW to another (`load_state(state())`) is the second one's own: the
/// fused kernel updates moments in place, and must not reach the first optimizer's. A state with
/// only the second moment restored steps as the CPU does (zero first moment, kept second one).
#[test]
fn loaded_state_is_not_shared_and_partial_state_steps_as_on_the_cpu() -> anyhow::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let step = |d: &Device, opt: &mut AdamW, w: &Var, seed: u64| -> anyhow::Result<()> {
        let g = random_tensor(&[64], seed, &Device::Cpu)?.to_device(d)?;
        opt.step(std::slice::from_ref(w), &[Some(g)], 1e-2)?;
        Ok(())
    };
    let w0 = random_tensor(&[64], 1, &Device::Cpu)?;
    let wa = Var::from_tensor(&w0.to_device(&dev)?)?;
    let mut a = AdamW::new(1, AdamWConfig::default());
    step(&dev, &mut a, &wa, 2)?;
    let before: Vec<Vec<f32>> = a
        .state()
        .1
        .iter()
        .map(|(_, t)| host(t))
        .collect::<anyhow::Result<_>>()?;
    let mut b = AdamW::new(1, AdamWConfig::default());
    let (t, tensors) = a.state();
    b.load_state(t, &tensors)?;
    let wb = Var::from_tensor(&wa.as_tensor().copy()?)?;
    step(&dev, &mut b, &wb, 3)?;
    let after: Vec<Vec<f32>> = a
        .state()
        .1
        .iter()
        .map(|(_, t)| host(t))
        .collect::<anyhow::Result<_>>()?;
    assert_eq!(
        before, after,
        "stepping the loaded optimizer changed the original's moments"
    );

    // Only `exp_avg_sq.0` restored, on both devices.
    let partial = |d: &Device| -> anyhow::Result<Vec<f32>> {
        let w = Var::from_tensor(&w0.to_device(d)?)?;
        let mut o = AdamW::new(1, AdamWConfig::default());
        let v = (random_tensor(&[64], 4, &Device::Cpu)?.sqr()? * 1e-2)?.to_device(d)?;
        o.load_state(5, &[("exp_avg_sq.0".to_string(), v)])?;
        step(d, &mut o, &w, 6)?;
        host(w.as_tensor())
    };
    let (c, g) = (partial(&Device::Cpu)?, partial(&dev)?);
    for (x, y) in g.iter().zip(&c) {
        assert!(
            (x - y).abs() <= 1e-6 * y.abs().max(1.0),
            "partial state: {x} vs {y}"
        );
    }
    Ok(())
}

/// A checkpoint taken with the state beside a CUDA model (moments on the GPU) restores into an
/// optimizer whose state is on the host, and the reverse: the moments follow the masters to
/// their device at the next step, which matches the uninterrupted run. The same for 8-bit
/// moments (codes and block maxima) of a quantized parameter.
#[test]
fn state_moves_between_gpu_and_host_placements() -> anyhow::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // 5,360 weights: 20 full quantization blocks and a partial one.
    let shape = [80, 67];
    for eight_bit in [false, true] {
        let make = |placement: StatePlacement| -> anyhow::Result<MixedOptimizer> {
            let w = random_tensor(&shape, 1, &Device::Cpu)?.to_dtype(DType::BF16)?;
            Ok(MixedOptimizer::new(
                vec![("w".into(), Var::from_tensor(&w.to_device(&dev)?)?)],
                Precision::parse("bf16")?,
                placement,
                optimizer(eight_bit),
                Some(1.0),
            )?)
        };
        let grad = |seed: u64| -> anyhow::Result<Vec<Option<Tensor>>> {
            let g = random_tensor(&shape, seed, &Device::Cpu)?.to_dtype(DType::BF16)?;
            Ok(vec![Some(g.to_device(&dev)?)])
        };
        for (from, to) in [
            (StatePlacement::WithModel, StatePlacement::Host),
            (StatePlacement::Host, StatePlacement::WithModel),
        ] {
            let mut a = make(from)?;
            a.step(grad(2)?, 1e-2)?;
            let (t, scale, tensors) = a.state();
            if eight_bit {
                assert!(tensors.iter().any(|(_, t)| t.dtype() == DType::U8));
            }
            let mut b = make(to)?;
            b.params()[0].set(a.params()[0].as_tensor())?;
            for (name, tensor) in &tensors {
                b.load_state(t, scale, &[(name.clone(), tensor.copy()?)])?;
            }
            a.step(grad(3)?, 1e-2)?;
            b.step(grad(3)?, 1e-2)?;
            close(
                &format!("8-bit {eight_bit}: {from:?} -> {to:?} masters"),
                &vec![host(a.masters()[0].as_tensor())?],
                &vec![host(b.masters()[0].as_tensor())?],
                if eight_bit { 1e-4 } else { 1e-5 },
            );
            let (_, moments) = b.optimizer().state();
            for (name, m) in moments {
                assert!(
                    m.device().same_device(&b.state_device()),
                    "{name} not on the state's device"
                );
            }
        }
    }
    Ok(())
}
