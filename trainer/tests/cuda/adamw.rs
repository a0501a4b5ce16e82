//! The fused AdamW kernels against the host update: 8-bit moments, the folded gradient factor,
//! bf16 weights without masters.

use candle_core::{DType, Device, Tensor, Var};
use ft_kernels::gradcheck::random_tensor;
use ft_trainer::update::{MixedOptimizer, Precision, StatePlacement};

use super::common::{bf16_grads, bf16_params, gpu, host, kernels_on, optimizer};

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
