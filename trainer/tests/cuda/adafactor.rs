//! The fused Adafactor kernels against the host update.

use candle_core::{DType, Device, Var};
use ft_trainer::update::{MixedOptimizer, Precision, StatePlacement};

use super::common::{bf16_grads, bf16_params, close, gpu, host, kernels_on, Values};

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
