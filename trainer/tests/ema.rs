//! The host-side EMA: the average diffusers' EMAModel computes, updates every N steps, and a
//! swap-in for evaluation that restores the model bit-exactly.

use candle_core::{DType, Device, Tensor, Var};
use ft_trainer::train::ema::Ema;

fn vars() -> anyhow::Result<Vec<Var>> {
    let dev = Device::Cpu;
    Ok(vec![
        Var::from_tensor(&Tensor::arange(0f32, 6.0, &dev)?.reshape((2, 3))?)?,
        Var::from_tensor(&Tensor::new(&[1.5f32, -2.0], &dev)?)?,
    ])
}

fn names() -> Vec<String> {
    vec!["a.weight".into(), "b.bias".into()]
}

#[test]
fn average_follows_diffusers_warmup_formula() -> anyhow::Result<()> {
    let p = vars()?;
    let mut ema = Ema::new(&names(), &p, 0.9999, 1, &Device::Cpu)?;
    let mut want: Vec<Vec<f32>> = vec![
        p[0].as_tensor().flatten_all()?.to_vec1()?,
        p[1].as_tensor().to_vec1()?,
    ];
    for step in 1..=5u64 {
        // The optimizer changes the weights in place; the average must not alias them.
        for v in &p {
            v.set(&(v.as_tensor() + 1.0)?)?;
        }
        assert!(ema.maybe_update(step, &p)?);
        let d = (0.9999f64).min((1.0 + step as f64) / (10.0 + step as f64));
        for (w, v) in want.iter_mut().zip(&p) {
            let cur: Vec<f32> = v.as_tensor().flatten_all()?.to_vec1()?;
            for (x, c) in w.iter_mut().zip(cur) {
                *x = (*x as f64 * d + c as f64 * (1.0 - d)) as f32;
            }
        }
    }
    for ((_, t), w) in ema.tensors().iter().zip(&want) {
        let got: Vec<f32> = t.flatten_all()?.to_vec1()?;
        for (g, w) in got.iter().zip(w) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
    }
    assert_eq!(ema.bytes(), 8 * 4);
    Ok(())
}

#[test]
fn updates_only_every_n_steps_with_matching_decay() -> anyhow::Result<()> {
    let p = vars()?;
    let mut ema = Ema::new(&names(), &p, 0.99, 4, &Device::Cpu)?;
    assert!(!ema.maybe_update(3, &p)?);
    assert!(ema.maybe_update(4, &p)?);
    let d1 = (0.99f64).min(5.0 / 14.0);
    assert!((ema.decay_at(4) - d1.powi(4)).abs() < 1e-12);
    assert!((ema.decay_at(100_000) - 0.99f64.powi(4)).abs() < 1e-12);
    assert!(Ema::new(&names(), &p, 1.0, 1, &Device::Cpu).is_err());
    assert!(Ema::new(&names(), &p, 0.9, 0, &Device::Cpu).is_err());
    Ok(())
}

#[test]
fn swap_in_then_restore_is_exact_and_keeps_dtype() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let p = vec![Var::from_tensor(
        &Tensor::new(&[0.1f32, 0.2, 0.3], &dev)?.to_dtype(DType::BF16)?,
    )?];
    let before: Vec<f32> = p[0].as_tensor().to_dtype(DType::F32)?.to_vec1()?;
    let masters = vec![Var::from_tensor(&Tensor::new(&[5f32, 6.0, 7.0], &dev)?)?];
    let ema = Ema::new(&["w".to_string()], &masters, 0.5, 1, &dev)?;
    let stash = ema.swap_in(&p)?;
    assert_eq!(p[0].dtype(), DType::BF16);
    let swapped: Vec<f32> = p[0].as_tensor().to_dtype(DType::F32)?.to_vec1()?;
    assert_eq!(swapped, vec![5.0, 6.0, 7.0]);
    stash.restore(&p)?;
    let after: Vec<f32> = p[0].as_tensor().to_dtype(DType::F32)?.to_vec1()?;
    assert_eq!(before, after);
    Ok(())
}
