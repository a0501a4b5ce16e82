//! Euler and DDIM samplers against diffusers (fixture from scripts/sampler_parity.py): the same
//! timesteps, initial noise scale and final latents for a fixed stand-in model.

use candle_core::{DType, Device, Tensor};
use ft_models::diffusion::{NoiseSchedule, SchedulerConfig};
use ft_models::sampling::{Sampler, SamplerKind};

fn fixture() -> anyhow::Result<serde_json::Value> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/sampling/sampling.json");
    Ok(serde_json::from_str(&std::fs::read_to_string(p)?)?)
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default()
}

#[test]
fn euler_and_ddim_match_diffusers() -> anyhow::Result<()> {
    let fx = fixture()?;
    let dev = Device::Cpu;
    let noise = Tensor::from_vec(floats(&fx["noise"]), (2, 4, 2, 2), &dev)?;
    for (name, kind) in [("euler", SamplerKind::Euler), ("ddim", SamplerKind::Ddim)] {
        for pred in ["epsilon", "v_prediction"] {
            let case = &fx[format!("{name}/{pred}")];
            let schedule = NoiseSchedule::new(&SchedulerConfig {
                num_train_timesteps: 1000,
                beta_start: 0.00085,
                beta_end: 0.012,
                beta_schedule: "scaled_linear".into(),
                prediction_type: pred.into(),
                steps_offset: 1,
            })?;
            let s = Sampler::new(kind, &schedule, 10)?;
            let want: Vec<usize> = floats(&case["timesteps"])
                .iter()
                .map(|t| *t as usize)
                .collect();
            assert_eq!(s.timesteps(), want.as_slice(), "{name}/{pred} timesteps");
            let sigma = case["init_noise_sigma"].as_f64().unwrap_or(0.0);
            assert!(
                (s.init_noise_sigma() - sigma).abs() < 1e-4 * sigma,
                "{name}/{pred}: init sigma {} vs {sigma}",
                s.init_noise_sigma()
            );
            let mut x = (&noise * s.init_noise_sigma())?;
            for (i, &t) in s.timesteps().iter().enumerate() {
                let out = ((s.scale_input(&x, i)? * 0.3)? + 0.05 * t as f64 / 1000.0)?;
                x = s.step(&out, i, &x)?;
            }
            let want = Tensor::from_vec(floats(&case["final"]), (2, 4, 2, 2), &dev)?;
            let err = (&x - &want)?.abs()?.max_all()?.to_scalar::<f64>()?
                / want.abs()?.max_all()?.to_scalar::<f64>()?;
            assert!(err < 1e-4, "{name}/{pred}: final latents differ by {err}");
            assert_eq!(x.dtype(), DType::F64);
        }
    }
    Ok(())
}

#[test]
fn impossible_step_counts_are_refused() -> anyhow::Result<()> {
    let schedule = NoiseSchedule::new(&SchedulerConfig {
        num_train_timesteps: 1000,
        beta_start: 0.00085,
        beta_end: 0.012,
        beta_schedule: "scaled_linear".into(),
        prediction_type: "epsilon".into(),
        steps_offset: 1,
    })?;
    assert!(Sampler::new(SamplerKind::Euler, &schedule, 0).is_err());
    assert!(Sampler::new(SamplerKind::Ddim, &schedule, 1001).is_err());
    assert!("heun".parse::<SamplerKind>().is_err());
    Ok(())
}
