//! Adafactor against `transformers.optimization.Adafactor` (fixture from
//! `scripts/adafactor_parity.py`): a matrix and a 3-D tensor (factored second moments) and a
//! vector (a full one), four steps, in HF Trainer's configuration (schedule learning rate,
//! weight decay), the paper's (relative step, parameter scale, first moment), and a loose
//! clipping threshold with another decay rate.

use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use ft_trainer::optim::adafactor::{state_bytes_for, Adafactor, AdafactorConfig};
use ft_trainer::optim::Optimizer;

fn fixture() -> anyhow::Result<serde_json::Value> {
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/adafactor/adafactor.json");
    Ok(serde_json::from_str(&std::fs::read_to_string(&p)?)?)
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

fn shapes(f: &serde_json::Value) -> Vec<Vec<usize>> {
    f["shapes"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|s| floats(s).iter().map(|d| *d as usize).collect())
                .collect()
        })
        .unwrap_or_default()
}

/// Largest difference relative to the larger of 1e-3 and the value's magnitude.
fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
        .fold(0.0, f32::max)
}

fn values(t: &Tensor) -> anyhow::Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

#[test]
fn adafactor_matches_transformers() -> anyhow::Result<()> {
    let f = fixture()?;
    let shapes = shapes(&f);
    let cases = [
        ("trainer", AdafactorConfig::trainer(0.01), 1e-2),
        (
            "paper",
            AdafactorConfig {
                beta1: Some(0.9),
                ..AdafactorConfig::paper()
            },
            // Ignored: the relative step sets the size.
            123.0,
        ),
        (
            "loose_clip",
            AdafactorConfig {
                clip_threshold: 4.0,
                decay_rate: -0.5,
                ..AdafactorConfig::trainer(0.0)
            },
            1e-2,
        ),
    ];
    for (name, cfg, lr) in cases {
        let case = &f["cases"][name];
        let params: Vec<Var> = shapes
            .iter()
            .enumerate()
            .map(|(k, s)| {
                Var::from_tensor(&Tensor::from_vec(
                    floats(&f["init"][k]),
                    s.as_slice(),
                    &Device::Cpu,
                )?)
            })
            .collect::<candle_core::Result<_>>()?;
        let mut opt = Adafactor::new(params.len(), cfg);
        let steps = case["weights"].as_array().map_or(0, |a| a.len());
        assert_eq!(steps, 4);
        for step in 0..steps {
            let grads: Vec<Option<Tensor>> = shapes
                .iter()
                .enumerate()
                .map(|(k, s)| {
                    Tensor::from_vec(floats(&case["grads"][step][k]), s.as_slice(), &Device::Cpu)
                        .map(Some)
                })
                .collect::<candle_core::Result<_>>()?;
            opt.step(&params, &grads, lr)?;
            for (k, p) in params.iter().enumerate() {
                let e = rel(&values(p.as_tensor())?, &floats(&case["weights"][step][k]));
                assert!(e < 2e-5, "{name} step {step} param {k}: rel err {e:.2e}");
            }
        }
        // The state, by transformers' names.
        let (t, state) = opt.state();
        assert_eq!(t, 4);
        for (k, want) in case["state"].as_array().into_iter().flatten().enumerate() {
            for (key, v) in want.as_object().into_iter().flatten() {
                let name = format!("{key}.{k}");
                let got = state
                    .iter()
                    .find(|(n, _)| *n == name)
                    .unwrap_or_else(|| panic!("{name} missing from the state"));
                let e = rel(&values(&got.1)?, &floats(v));
                assert!(
                    e < 2e-5,
                    "{name_case} {name}: rel err {e:.2e}",
                    name_case = name
                );
            }
        }
        let beta1 = cfg.beta1.is_some();
        let want: u64 = shapes.iter().map(|s| state_bytes_for(s, beta1)).sum();
        assert_eq!(opt.state_bytes(), want);
    }
    // Factored: a 4 x 6 matrix keeps 4 + 6 values, not 24.
    assert_eq!(state_bytes_for(&[4, 6], false), 40);
    assert_eq!(state_bytes_for(&[2, 3, 5], false), 4 * (6 + 10));
    assert_eq!(state_bytes_for(&[7], false), 28);
    Ok(())
}

/// A checkpoint of the state resumes the run exactly; state of the wrong shape or dtype is
/// refused by name.
#[test]
fn adafactor_resumes_exactly_and_checks_what_it_restores() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let w0 = Tensor::arange(0f32, 60.0, &dev)?.reshape((6, 10))?.sin()?;
    let grad = |s: u64| -> candle_core::Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(
            ((Tensor::arange(0f32, 60.0, &dev)?.reshape((6, 10))? * (0.3 + s as f64))?.cos()?
                * 0.1)?,
        )])
    };
    let cfg = AdafactorConfig::trainer(0.01);
    let a = [Var::from_tensor(&w0)?];
    let mut full = Adafactor::new(1, cfg);
    for s in 0..4 {
        full.step(&a, &grad(s)?, 1e-2)?;
    }
    let b = [Var::from_tensor(&w0)?];
    let mut first = Adafactor::new(1, cfg);
    for s in 0..2 {
        first.step(&b, &grad(s)?, 1e-2)?;
    }
    let (t, state) = first.state();
    let mut second = Adafactor::new(1, cfg);
    second.load_state(t, &state)?;
    for s in 2..4 {
        second.step(&b, &grad(s)?, 1e-2)?;
    }
    assert_eq!(values(a[0].as_tensor())?, values(b[0].as_tensor())?);

    for bad in [
        Tensor::zeros(5, DType::F32, &dev)?,
        Tensor::zeros(6, DType::F16, &dev)?,
    ] {
        let mut o = Adafactor::new(1, cfg);
        let r = o
            .load_state(1, &[("exp_avg_sq_row.0".into(), bad)])
            .and_then(|_| o.step(&b, &grad(0)?, 1e-2));
        let e = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("exp_avg_sq_row"), "{e}");
    }
    Ok(())
}
