//! AdamW and SGD follow torch's update rules; schedules follow transformers'.

use candle_core::{DType, Device, Tensor, Var};
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer, Sgd};
use ft_trainer::train::schedule::{LrSchedule, ScheduleKind};

mod common;
use common::bits;

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

/// Clipping's factor folded into the update (`Optimizer::update`, what MixedOptimizer
/// uses) gives the bits of scaling copies of the gradients first (what clipping did before),
/// for the one-pass host AdamW, Adafactor, the op-by-op AdamW, 8-bit AdamW and SGD (the trait's
/// default),
/// with bf16 gradients as a single micro-batch leaves them, into fp32 masters and a bf16 model.
#[test]
fn folded_clip_factor_equals_scaling_the_gradients_first() -> anyhow::Result<()> {
    use ft_kernels::gradcheck::random_tensor;
    use ft_trainer::optim::adamw8bit::AdamW8bit;
    let dev = Device::Cpu;
    let shapes: [&[usize]; 2] = [&[80, 64], &[37]];
    let coef = 0.3173;
    let make: [fn(usize) -> Box<dyn Optimizer>; 5] = [
        |n| Box::new(AdamW::new(n, AdamWConfig::default())),
        |n| {
            let c = ft_trainer::optim::adafactor::AdafactorConfig::trainer(0.01);
            Box::new(ft_trainer::optim::adafactor::Adafactor::new(n, c))
        },
        |n| Box::new(AdamW::new(n, AdamWConfig::default()).op_by_op()),
        |n| Box::new(AdamW8bit::new(n, AdamWConfig::default())),
        |n| Box::new(Sgd::new(n, 0.9, 0.01, false)),
    ];
    let bits = |vs: &[Var]| -> anyhow::Result<Vec<Vec<u32>>> {
        vs.iter().map(|v| Ok(bits(v.as_tensor())?)).collect()
    };
    for (k, make) in make.iter().enumerate() {
        type Bits = Vec<Vec<u32>>;
        let run = |folded: bool| -> anyhow::Result<(Bits, Bits)> {
            let masters: Vec<Var> = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    Var::from_tensor(&random_tensor(s, i as u64, &dev)?.to_dtype(DType::F32)?)
                })
                .collect::<candle_core::Result<_>>()?;
            let model: Vec<Var> = masters
                .iter()
                .map(|m| Var::from_tensor(&m.as_tensor().to_dtype(DType::BF16)?))
                .collect::<candle_core::Result<_>>()?;
            let mut opt = make(masters.len());
            for step in 0..3u64 {
                let grads: Vec<Option<Tensor>> = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let g = random_tensor(s, 10 + 10 * step + i as u64, &dev)?;
                        Ok(Some((g * (1.0 + step as f64))?.to_dtype(DType::BF16)?))
                    })
                    .collect::<candle_core::Result<_>>()?;
                if folded {
                    opt.update(&masters, &grads, 1e-2, coef, Some(&model))?;
                } else {
                    let scaled: Vec<Option<Tensor>> = grads
                        .iter()
                        .map(|g| {
                            g.as_ref()
                                .map(|g| g.to_dtype(DType::F32)?.affine(coef, 0.0))
                        })
                        .map(|g| g.transpose())
                        .collect::<candle_core::Result<_>>()?;
                    opt.step_into(&masters, &scaled, 1e-2, &model)?;
                }
            }
            Ok((bits(&masters)?, bits(&model)?))
        };
        let (a, b) = (run(true)?, run(false)?);
        assert_eq!(a.0, b.0, "optimizer {k}: masters");
        assert_eq!(a.1, b.1, "optimizer {k}: model weights");
    }
    Ok(())
}

/// `exempt_from_weight_decay`: with zero gradients only weight decay moves a weight, so the
/// exempt parameter stays put and the other shrinks, for every optimizer; HF Trainer's rule
/// picks biases and layer norms by name.
#[test]
fn exempt_parameters_get_no_weight_decay() -> anyhow::Result<()> {
    use ft_trainer::optim::adafactor::{Adafactor, AdafactorConfig};
    use ft_trainer::optim::adamw8bit::AdamW8bit;
    use ft_trainer::optim::hf_trainer_no_decay;
    let dev = Device::Cpu;
    let wd = AdamWConfig {
        weight_decay: 0.5,
        ..Default::default()
    };
    let make: [fn(AdamWConfig) -> Box<dyn Optimizer>; 5] = [
        |c| Box::new(AdamW::new(2, c)),
        |c| Box::new(AdamW::new(2, c).op_by_op()),
        |c| Box::new(AdamW8bit::new(2, c)),
        |c| Box::new(Adafactor::new(2, AdafactorConfig::trainer(c.weight_decay))),
        |c| Box::new(Sgd::new(2, 0.0, c.weight_decay, false)),
    ];
    for (k, make) in make.iter().enumerate() {
        let params = [
            Var::from_tensor(&Tensor::ones((4, 3), DType::F32, &dev)?)?,
            Var::from_tensor(&Tensor::ones((4, 3), DType::F32, &dev)?)?,
        ];
        let mut opt = make(wd);
        opt.exempt_from_weight_decay(vec![true, false]);
        let zeros = || Tensor::zeros((4, 3), DType::F32, &dev).map(Some);
        opt.step(&params, &[zeros()?, zeros()?], 0.1)?;
        let mean = |v: &Var| v.as_tensor().mean_all()?.to_scalar::<f32>();
        assert_eq!(mean(&params[0])?, 1.0, "optimizer {k}: exempt");
        assert!(mean(&params[1])? < 0.99, "optimizer {k}: decayed");
    }
    for (name, exempt) in [
        (
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            true,
        ),
        ("encoder.block.0.layer.0.layer_norm.weight", true),
        ("decoder.final_layer_norm.weight", true),
        ("encoder.block.0.layer.1.DenseReluDense.wi_0.weight", false),
        ("shared.weight", false),
    ] {
        assert_eq!(hf_trainer_no_decay(name), exempt, "{name}");
    }
    Ok(())
}
