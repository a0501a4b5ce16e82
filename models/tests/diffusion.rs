//! The diffusion objective against diffusers (fixture from scripts/ddpm_parity.py): SDXL's
//! scaled-linear schedule, noising, v-prediction target and min-SNR-gamma weights.

use std::path::Path;

use candle_core::{Device, Tensor};
use ft_models::diffusion::{time_ids, NoiseSchedule, SchedulerConfig};

fn fixture() -> anyhow::Result<serde_json::Value> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/ddpm/ddpm.json");
    Ok(serde_json::from_str(&std::fs::read_to_string(p)?)?)
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_f64())
                .map(|x| x as f32)
                .collect()
        })
        .unwrap_or_default()
}

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * y.abs().max(0.1),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn schedule_noising_targets_and_weights_match_diffusers() -> anyhow::Result<()> {
    let f = fixture()?;
    let dev = Device::Cpu;
    let t: Vec<usize> = f["timesteps"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as usize)
                .collect()
        })
        .unwrap_or_default();
    let x0 = Tensor::from_vec(floats(&f["x0"]), (5, 2, 2, 2), &dev)?;
    let noise = Tensor::from_vec(floats(&f["noise"]), (5, 2, 2, 2), &dev)?;
    for pred in ["epsilon", "v_prediction"] {
        let cfg: SchedulerConfig = serde_json::from_value(f[pred]["config"].clone())?;
        let s = NoiseSchedule::new(&cfg)?;
        let acp: Vec<f32> = t.iter().map(|&i| s.alphas_cumprod[i] as f32).collect();
        close(
            &acp,
            &floats(&f[pred]["alphas_cumprod"]),
            1e-5,
            "alphas_cumprod",
        );
        let noisy = s
            .add_noise(&x0, &noise, &t)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        close(&noisy, &floats(&f[pred]["noisy"]), 1e-5, "add_noise");
        let target = s.target(&x0, &noise, &t)?.flatten_all()?.to_vec1::<f32>()?;
        let want = if pred == "epsilon" {
            floats(&f["noise"])
        } else {
            floats(&f[pred]["velocity"])
        };
        close(&target, &want, 1e-5, "target");
        let w: Vec<f32> = s
            .min_snr_weights(&t, 5.0)
            .iter()
            .map(|x| *x as f32)
            .collect();
        close(&w, &floats(&f[pred]["min_snr_5"]), 1e-4, "min_snr");
    }
    Ok(())
}

#[test]
fn bad_schedule_settings_are_errors_naming_the_file() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("ddpm-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let p = dir.join("scheduler_config.json");
    std::fs::write(&p, r#"{"beta_schedule": "squaredcos_cap_v3"}"#)?;
    let e = NoiseSchedule::from_file(&p).unwrap_err().to_string();
    assert!(
        e.contains("scheduler_config.json") && e.contains("squaredcos_cap_v3"),
        "{e}"
    );
    let s = NoiseSchedule::new(&serde_json::from_str(r#"{"prediction_type": "epsilon"}"#)?)?;
    assert!(s
        .add_noise(
            &Tensor::zeros((1, 1, 1, 1), candle_core::DType::F32, &Device::Cpu)?,
            &Tensor::zeros((1, 1, 1, 1), candle_core::DType::F32, &Device::Cpu)?,
            &[1000]
        )
        .is_err());
    let ids = time_ids((1024, 768), (0, 32), (1024, 1024), &Device::Cpu)?.to_vec1::<f32>()?;
    assert_eq!(ids, vec![1024., 768., 0., 32., 1024., 1024.]);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
