//! The CUDA optimizer path (fused AdamW writing the bf16 weights, the 8-bit AdamW and Adafactor
//! kernels, fused f16 unscale) against the CPU path on the same parameters and gradients. Built
//! only with `--features cuda`; each test returns early, saying so, when no GPU can be opened (a
//! failure instead with `FT_REQUIRE_GPU=1`, as `scripts/gpu-bench.sh` runs them, so a broken
//! driver is no pass).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor, Var};
use ft_kernels::gradcheck::random_tensor;
use ft_trainer::optim::adamw8bit::AdamW8bit;
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer};
use ft_trainer::update::{MixedOptimizer, Precision, StatePlacement};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("FT_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("FT_REQUIRE_GPU=1 but no CUDA device: {e}")
        }
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

/// Named bf16 parameters of these shapes on `d`, seeded by their index (the same values on
/// every device).
fn bf16_params(shapes: &[&[usize]], d: &Device) -> anyhow::Result<Vec<(String, Var)>> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let t = random_tensor(s, i as u64, &Device::Cpu)?.to_dtype(DType::BF16)?;
            Ok((format!("p{i}"), Var::from_tensor(&t.to_device(d)?)?))
        })
        .collect()
}

/// One bf16 gradient per shape on `d`, seeded from `seed` and the index.
fn bf16_grads(shapes: &[&[usize]], seed: u64, d: &Device) -> anyhow::Result<Vec<Option<Tensor>>> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let g = random_tensor(s, seed + i as u64, &Device::Cpu)?;
            Ok(Some(g.to_dtype(DType::BF16)?.to_device(d)?))
        })
        .collect()
}

/// Whether the project's CUDA kernels are on; says why a test skips when not.
fn kernels_on() -> bool {
    let on = ft_kernels::cuda::enabled();
    if !on {
        eprintln!("skipped: FT_CUDA_KERNELS is off");
    }
    on
}

/// Host copies of each parameter's values.
type Values = Vec<Vec<f32>>;

/// What a run leaves: masters, model weights, AdamW moments, the global norm of each step.
struct Run {
    masters: Values,
    model: Values,
    moments: Values,
    norms: Vec<f64>,
}

fn close(what: &str, a: &Values, b: &Values, tol: f32) {
    for (i, (a, b)) in a.iter().zip(b).enumerate() {
        assert_eq!(a.len(), b.len(), "{what} {i}: lengths");
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= tol * y.abs().max(1.0),
                "{what} {i}: {x} vs {y}"
            );
        }
    }
}

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

/// The optimizer a test builds: 32-bit AdamW, or the 8-bit one.
fn optimizer(eight_bit: bool) -> impl FnOnce(usize) -> Box<dyn Optimizer> {
    move |n| -> Box<dyn Optimizer> {
        if eight_bit {
            Box::new(AdamW8bit::new(n, AdamWConfig::default()))
        } else {
            Box::new(AdamW::new(n, AdamWConfig::default()))
        }
    }
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

/// The 8-bit AdamW kernel against the host update, through MixedOptimizer (bf16 model, fp32
/// masters) over four steps: a quantized parameter (5,360 weights: 20 full blocks and a partial
/// one; its gradient strided) and a small one with fp32 moments. The kernels do the host's
/// arithmetic operation for operation (rounded intrinsics, no FMA contraction), so masters,
/// codes, block maxima and fp32 moments must be equal bit for bit, and the model weights their
/// rounded masters. No clipping here: the GPU's global norm sums in another order, and its
/// factor may differ in the last bit. The GPU run keeps every state tensor on the GPU.
#[test]
fn eight_bit_adamw_on_the_gpu_matches_the_host() -> anyhow::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    if !ft_kernels::cuda::enabled() {
        eprintln!("skipped: FT_CUDA_KERNELS is off, and the 8-bit step on a GPU needs them");
        return Ok(());
    }
    let shapes: [&[usize]; 2] = [&[80, 67], &[300]];
    let run = |d: &Device| -> anyhow::Result<MixedOptimizer> {
        let params = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let t = random_tensor(s, i as u64, &Device::Cpu)?.to_dtype(DType::BF16)?;
                Ok((format!("p{i}"), Var::from_tensor(&t.to_device(d)?)?))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut opt = MixedOptimizer::new(
            params,
            Precision::parse("bf16")?,
            StatePlacement::WithModel,
            optimizer(true),
            None,
        )?;
        for step in 0..4u64 {
            let grads = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let g = (random_tensor(s, 100 + 10 * step + i as u64, &Device::Cpu)? * 0.05)?
                        .to_dtype(DType::BF16)?;
                    let g = if i == 0 { g.t()?.contiguous()?.t()? } else { g };
                    Ok(Some(g.to_device(d)?))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            opt.step(grads, 1e-2)?;
        }
        Ok(opt)
    };
    let cpu = run(&Device::Cpu)?;
    let launched = ft_kernels::cuda::launches_of("adamw8bit_");
    let gpu_opt = run(&dev)?;
    assert!(
        ft_kernels::cuda::launches_of("adamw8bit_") > launched,
        "the 8-bit kernel did not run"
    );
    let bits = |t: &Tensor| -> anyhow::Result<Vec<u32>> {
        Ok(match t.dtype() {
            DType::U8 => t
                .to_device(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<u8>()?
                .into_iter()
                .map(u32::from)
                .collect(),
            _ => host(t)?.iter().map(|v| v.to_bits()).collect(),
        })
    };
    for (i, (g, c)) in gpu_opt.masters().iter().zip(cpu.masters()).enumerate() {
        assert_eq!(bits(g.as_tensor())?, bits(c.as_tensor())?, "master {i}");
    }
    let (gs, cs) = (gpu_opt.optimizer().state(), cpu.optimizer().state());
    assert_eq!(gs.0, 4);
    let names = |s: &[(String, Tensor)]| s.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&gs.1),
        names(&cs.1),
        "the same state tensors, for the same checkpoints"
    );
    for ((name, g), (_, c)) in gs.1.iter().zip(&cs.1) {
        assert!(g.device().same_device(&dev), "{name} left the GPU");
        assert_eq!((g.dtype(), g.dims()), (c.dtype(), c.dims()), "{name}");
        let (a, b) = (bits(g)?, bits(c)?);
        let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
        assert_eq!(differ, 0, "{name}: {differ} of {} values differ", a.len());
    }
    let n8: usize = 80 * 67;
    assert_eq!(
        gpu_opt.optimizer().state_bytes(),
        (2 * n8 + 2 * 4 * n8.div_ceil(256) + 2 * 4 * 300) as u64,
        "codes, block maxima and the small parameter's fp32 moments"
    );
    for (i, (m, w)) in gpu_opt.masters().iter().zip(gpu_opt.params()).enumerate() {
        let rounded = m.as_tensor().to_dtype(DType::BF16)?;
        assert_eq!(host(&rounded)?, host(w.as_tensor())?, "model weight {i}");
    }
    Ok(())
}

/// The fused kernels against the host update with a gradient factor (clipping's, folded into
/// the read: `Optimizer::update`), for AdamW and 8-bit AdamW: fp32 masters and the bf16
/// weights they write, bit for bit, over three steps with weight decay.
#[test]
fn folded_gradient_factor_matches_the_host_bit_for_bit() -> anyhow::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    if !kernels_on() {
        return Ok(());
    }
    let shapes: [&[usize]; 2] = [&[80, 67], &[300]];
    type Bits = Vec<Vec<u32>>;
    let bits = |vs: &[Var]| -> anyhow::Result<Bits> {
        vs.iter()
            .map(|v| Ok(host(v.as_tensor())?.iter().map(|x| x.to_bits()).collect()))
            .collect()
    };
    for eight_bit in [false, true] {
        let run = |d: &Device| -> anyhow::Result<(Bits, Bits)> {
            let init = |i: usize, s: &[usize]| random_tensor(s, i as u64, &Device::Cpu);
            let masters: Vec<Var> = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    Ok(Var::from_tensor(
                        &init(i, s)?.to_dtype(DType::F32)?.to_device(d)?,
                    )?)
                })
                .collect::<anyhow::Result<_>>()?;
            let model: Vec<Var> = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    Ok(Var::from_tensor(
                        &init(i, s)?.to_dtype(DType::BF16)?.to_device(d)?,
                    )?)
                })
                .collect::<anyhow::Result<_>>()?;
            let mut opt = optimizer(eight_bit)(shapes.len());
            for step in 0..3u64 {
                let grads = bf16_grads(&shapes, 50 + 10 * step, d)?;
                opt.update(&masters, &grads, 1e-2, 0.3173, Some(&model))?;
            }
            Ok((bits(&masters)?, bits(&model)?))
        };
        let (cpu, gpu) = (run(&Device::Cpu)?, run(&dev)?);
        assert_eq!(gpu.0, cpu.0, "8-bit {eight_bit}: masters");
        assert_eq!(gpu.1, cpu.1, "8-bit {eight_bit}: bf16 weights");
    }
    Ok(())
}

/// `--full-bf16` with AdamW and 8-bit AdamW on a GPU: the fused kernels update the bf16 weights
/// in place (no masters) with the stochastic rounding the CPU update does for the same step and parameter,
/// so weights and moments equal the CPU run's bit for bit; fp32 state is only the moments.
#[test]
fn full_bf16_adamw_on_the_gpu_matches_the_host() -> anyhow::Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    if !kernels_on() {
        return Ok(());
    }
    let shapes: [&[usize]; 2] = [&[80, 67], &[300]];
    for eight_bit in [false, true] {
        let run = |d: &Device| -> anyhow::Result<MixedOptimizer> {
            let params = bf16_params(&shapes, d)?;
            let mut opt = MixedOptimizer::new(
                params,
                Precision::full_bf16(),
                StatePlacement::WithModel,
                optimizer(eight_bit),
                None,
            )?;
            assert!(opt.masters().is_empty());
            for step in 0..3u64 {
                let grads = bf16_grads(&shapes, 70 + 10 * step, d)?;
                opt.step(grads, 1e-3)?;
            }
            Ok(opt)
        };
        let cpu = run(&Device::Cpu)?;
        // The fused kernel updates the weights in place (not candle's ops and a rounding pass).
        let kernel = if eight_bit {
            "adamw8bit_bf16_bf16"
        } else {
            "adamw_bf16_bf16"
        };
        let launched = ft_kernels::cuda::launches_of(kernel);
        let rounded = ft_kernels::cuda::launches_of("round_stochastic");
        let gpu_opt = run(&dev)?;
        assert!(
            ft_kernels::cuda::launches_of(kernel) > launched,
            "{kernel} did not run"
        );
        assert_eq!(
            ft_kernels::cuda::launches_of("round_stochastic"),
            rounded,
            "a separate rounding pass ran"
        );
        let bits = |t: &Tensor| -> anyhow::Result<Vec<u32>> {
            Ok(host(t)?.iter().map(|v| v.to_bits()).collect())
        };
        for (i, (g, c)) in gpu_opt.params().iter().zip(cpu.params()).enumerate() {
            assert_eq!(g.dtype(), DType::BF16);
            assert_eq!(
                bits(g.as_tensor())?,
                bits(c.as_tensor())?,
                "8-bit {eight_bit}: weight {i}"
            );
        }
        for ((name, g), (_, c)) in gpu_opt
            .optimizer()
            .state()
            .1
            .iter()
            .zip(&cpu.optimizer().state().1)
        {
            assert_eq!(bits(g)?, bits(c)?, "{name}");
        }
    }
    Ok(())
}

/// Adafactor (HF Trainer's configuration, weight decay) on fp32 masters writing a bf16 model,
/// and `--full-bf16` (bf16 weights in place, stochastic rounding), on the GPU's fused kernels
/// against the host's candle ops over three steps with a gradient factor: a linear weight
/// (three column chunks), a convolution (factored over its 3 x 3 kernel), a batch of matrices
/// and a bias (a full second moment). The kernels add their sums in another order, so masters
/// and the factored state agree to f32 rounding, not bit for bit; a bf16 weight rounded from
/// them (to nearest, or stochastically from the same random bits) is the CPU's but where the two
/// fp32 values straddle a rounding boundary: at least 99% are equal bits, the rest one bf16 step
/// away.
#[test]
fn adafactor_on_the_gpu_matches_the_host() -> anyhow::Result<()> {
    use ft_trainer::optim::adafactor::{Adafactor, AdafactorConfig};
    let Some(dev) = gpu() else { return Ok(()) };
    if !kernels_on() {
        return Ok(());
    }
    let shapes: [&[usize]; 4] = [&[80, 67], &[12, 6, 3, 3], &[2, 70, 40], &[300]];
    for full_bf16 in [false, true] {
        let run = |d: &Device| -> anyhow::Result<MixedOptimizer> {
            let params = bf16_params(&shapes, d)?;
            let precision = if full_bf16 {
                Precision::full_bf16()
            } else {
                Precision::for_dtype(DType::BF16)
            };
            let mut opt = MixedOptimizer::new(
                params,
                precision,
                StatePlacement::WithModel,
                |n| Box::new(Adafactor::new(n, AdafactorConfig::trainer(0.01))),
                None,
            )?;
            for step in 0..3u64 {
                let grads = bf16_grads(&shapes, 90 + 10 * step, d)?;
                let (params, model) = if full_bf16 {
                    (opt.params().to_vec(), None)
                } else {
                    (opt.masters().to_vec(), Some(opt.params().to_vec()))
                };
                let o = opt.optimizer_mut();
                o.update(&params, &grads, 1e-2, 0.3173, model.as_deref())?;
            }
            Ok(opt)
        };
        let cpu = run(&Device::Cpu)?;
        let applied = ft_kernels::cuda::launches_of("adafactor_apply_bf16");
        let rounded = ft_kernels::cuda::launches_of("round_stochastic");
        let gpu_opt = run(&dev)?;
        assert_eq!(
            ft_kernels::cuda::launches_of("adafactor_apply_bf16") - applied,
            3 * shapes.len() as u64,
            "full bf16 {full_bf16}: one fused update per tensor and step"
        );
        assert_eq!(
            ft_kernels::cuda::launches_of("round_stochastic"),
            rounded,
            "a separate rounding pass ran"
        );
        let values = |vs: &[Var]| -> anyhow::Result<Values> {
            vs.iter().map(|v| host(v.as_tensor())).collect()
        };
        let what = format!("full bf16 {full_bf16}");
        if !full_bf16 {
            let (g, c) = (values(gpu_opt.masters())?, values(cpu.masters())?);
            close(&format!("{what}: masters"), &g, &c, 2e-6);
        }
        let (g, c) = (values(gpu_opt.params())?, values(cpu.params())?);
        close(&format!("{what}: bf16 weights"), &g, &c, 1.0 / 128.0);
        let (all, same) = g
            .iter()
            .flatten()
            .zip(c.iter().flatten())
            .fold((0usize, 0usize), |(n, s), (a, b)| {
                (n + 1, s + usize::from(a.to_bits() == b.to_bits()))
            });
        assert!(
            100 * same >= 99 * all,
            "{what}: {same} of {all} bf16 weights equal"
        );
        let (gs, cs) = (gpu_opt.optimizer().state(), cpu.optimizer().state());
        assert_eq!(gs.0, cs.0, "step count");
        assert_eq!(gs.1.len(), cs.1.len(), "state tensors");
        for ((name, g), (cname, c)) in gs.1.iter().zip(&cs.1) {
            assert_eq!(name, cname);
            close(
                &format!("{what}: {name}"),
                &vec![host(g)?],
                &vec![host(c)?],
                1e-5,
            );
        }
    }
    Ok(())
}
