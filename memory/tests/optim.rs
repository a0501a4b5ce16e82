//! AdamW and SGD follow torch's update rules; schedules follow transformers'.

use candle_core::{Device, Tensor, Var};
use ft_memory::optim::{AdamW, AdamWConfig, Optimizer, Sgd};
use ft_memory::schedule::{LrSchedule, ScheduleKind};

/// torch.optim.AdamW for one scalar, written out independently in f64.
fn adamw_reference(p0: f64, grads: &[f64], lr: f64, c: AdamWConfig) -> f64 {
    let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
    for (t, g) in grads.iter().enumerate() {
        let t = (t + 1) as i32;
        p *= 1.0 - lr * c.weight_decay;
        m = c.beta1 * m + (1.0 - c.beta1) * g;
        v = c.beta2 * v + (1.0 - c.beta2) * g * g;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        p -= lr / bc1 * m / (v.sqrt() / bc2.sqrt() + c.eps);
    }
    p
}

#[test]
fn adamw_matches_torch_formula_over_steps() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let p0 = [0.5f32, -1.25, 3.0, 1e-3];
    let grads = [
        [0.1f32, -0.2, 0.0, 5.0],
        [0.3, 0.1, -0.4, -5.0],
        [-0.05, 0.2, 0.1, 1.0],
    ];
    let cfg = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-6,
        weight_decay: 0.1,
    };
    let lr = 0.01;
    let p = Var::from_slice(&p0, 4, &dev)?;
    let mut opt = AdamW::new(1, cfg);
    for g in &grads {
        opt.step(std::slice::from_ref(&p), &[Some(Tensor::new(g, &dev)?)], lr)?;
    }
    let got = p.as_tensor().to_vec1::<f32>()?;
    for i in 0..4 {
        let gs: Vec<f64> = grads.iter().map(|g| g[i] as f64).collect();
        let want = adamw_reference(p0[i] as f64, &gs, lr, cfg);
        assert!(
            (got[i] as f64 - want).abs() < 1e-6,
            "element {i}: {} vs {want}",
            got[i]
        );
    }
    assert_eq!(
        opt.state_bytes(),
        2 * 4 * 4,
        "two fp32 moments of 4 elements"
    );
    let (step, state) = opt.state();
    assert_eq!(step, 3);
    assert_eq!(state.len(), 2);
    Ok(())
}

#[test]
fn adamw_state_roundtrip_continues_identically() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let cfg = AdamWConfig::default();
    let g1 = Tensor::new(&[0.3f32, -0.7], &dev)?;
    let g2 = Tensor::new(&[-0.1f32, 0.4], &dev)?;
    let a = Var::from_slice(&[1f32, 2.], 2, &dev)?;
    let mut oa = AdamW::new(1, cfg);
    oa.step(std::slice::from_ref(&a), &[Some(g1.clone())], 1e-2)?;
    let (t, st) = oa.state();
    let b = Var::from_tensor(&a.as_tensor().copy()?)?;
    let mut ob = AdamW::new(1, cfg);
    ob.load_state(t, &st)?;
    oa.step(std::slice::from_ref(&a), &[Some(g2.clone())], 1e-2)?;
    ob.step(std::slice::from_ref(&b), &[Some(g2)], 1e-2)?;
    assert_eq!(
        a.as_tensor().to_vec1::<f32>()?,
        b.as_tensor().to_vec1::<f32>()?
    );
    Ok(())
}

#[test]
fn sgd_momentum_and_nesterov_match_torch() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let gs = [0.5f64, -1.0, 0.25];
    for nesterov in [false, true] {
        let (lr, mu, wd) = (0.1, 0.9, 0.01);
        let p = Var::from_slice(&[2f32], 1, &dev)?;
        let mut opt = Sgd::new(1, mu, wd, nesterov);
        let (mut rp, mut buf) = (2f64, None::<f64>);
        for g in gs {
            opt.step(
                std::slice::from_ref(&p),
                &[Some(Tensor::new(&[g as f32], &dev)?)],
                lr,
            )?;
            let d = g + wd * rp;
            let b = match buf {
                Some(b) => mu * b + d,
                None => d,
            };
            buf = Some(b);
            rp -= lr * if nesterov { d + mu * b } else { b };
        }
        let got = p.as_tensor().to_vec1::<f32>()?[0] as f64;
        assert!(
            (got - rp).abs() < 1e-6,
            "nesterov={nesterov}: {got} vs {rp}"
        );
    }
    Ok(())
}

#[test]
fn parameters_without_gradient_are_left_alone() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let p = Var::from_slice(&[1f32, 2.], 2, &dev)?;
    let mut opt = AdamW::new(1, AdamWConfig::default());
    opt.step(std::slice::from_ref(&p), &[None], 0.1)?;
    assert_eq!(p.as_tensor().to_vec1::<f32>()?, vec![1., 2.]);
    assert!(opt
        .step(std::slice::from_ref(&p), &[None, None], 0.1)
        .is_err());
    Ok(())
}

#[test]
fn schedules_follow_transformers() {
    let s = |kind| LrSchedule {
        kind,
        base_lr: 1.0,
        warmup_steps: 10,
        total_steps: 110,
    };
    for kind in [
        ScheduleKind::Constant,
        ScheduleKind::Linear,
        ScheduleKind::Cosine,
    ] {
        assert_eq!(s(kind).lr_at(0), 0.0, "warmup starts at 0");
        assert!((s(kind).lr_at(5) - 0.5).abs() < 1e-12);
        assert!((s(kind).lr_at(10) - 1.0).abs() < 1e-12);
    }
    assert!((s(ScheduleKind::Linear).lr_at(60) - 0.5).abs() < 1e-12);
    assert_eq!(s(ScheduleKind::Linear).lr_at(200), 0.0);
    assert!((s(ScheduleKind::Cosine).lr_at(60) - 0.5).abs() < 1e-12);
    assert!(s(ScheduleKind::Cosine).lr_at(110).abs() < 1e-12);
    assert_eq!(s(ScheduleKind::Constant).lr_at(1000), 1.0);
    assert!("cosine".parse::<ScheduleKind>().is_ok());
    assert!("exp".parse::<ScheduleKind>().is_err());
}
