//! Master weights keep small updates, loss scaling skips overflowing steps, clipping bounds the norm.

use candle_core::{DType, Device, Tensor, Var};
use ft_trainer::optim::{AdamWConfig, Optimizer, Sgd};
use ft_trainer::update::{
    clip_grad_norm, global_norm, LossScaler, MixedOptimizer, Precision, StatePlacement,
};

mod common;
use common::bits;

fn sgd(n: usize) -> Box<dyn Optimizer> {
    Box::new(Sgd::new(n, 0.0, 0.0, false))
}

/// Plain SGD over the one parameter `w`, state beside it, no clipping.
fn plain_sgd(w: &Var, precision: Precision) -> anyhow::Result<MixedOptimizer> {
    let params = vec![("w".into(), w.clone())];
    Ok(MixedOptimizer::new(
        params,
        precision,
        StatePlacement::WithModel,
        sgd,
        None,
    )?)
}

#[test]
fn bf16_weights_need_fp32_masters_for_small_updates() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let run = |precision: Precision| -> anyhow::Result<(Tensor, MixedOptimizer)> {
        let w = Var::from_tensor(&Tensor::ones(64, DType::BF16, &dev)?)?;
        let mut opt = plain_sgd(&w, precision)?;
        // 100 updates of 1e-4 each: every one is below bf16's resolution at 1.0 (2^-8).
        for _ in 0..100 {
            let g = Tensor::ones(64, DType::BF16, &dev)?;
            opt.step(vec![Some(g)], 1e-4)?;
        }
        Ok((w.as_tensor().to_dtype(DType::F32)?, opt))
    };
    let (with_master, opt) = run(Precision::parse("bf16")?)?;
    let mut pure = Precision::parse("bf16")?;
    pure.master_weights = false;
    let (without, _) = run(pure)?;
    let moved = with_master.mean_all()?.to_scalar::<f32>()?;
    let stuck = without.mean_all()?.to_scalar::<f32>()?;
    assert_eq!(stuck, 1.0, "pure bf16 loses every update");
    assert!(
        (moved - 0.99).abs() < 0.004,
        "with masters the weight reaches ~0.99, got {moved}"
    );
    let master = opt.masters()[0]
        .as_tensor()
        .mean_all()?
        .to_scalar::<f32>()?;
    assert!((master - 0.99).abs() < 1e-4, "master {master}");
    assert_eq!(opt.masters()[0].dtype(), DType::F32);
    Ok(())
}

/// `Precision::full_bf16` (no masters, `--full-bf16`): the same 100 updates below bf16's
/// resolution move the weights on average, by stochastic rounding, where rounding to nearest
/// kept every one at 1.0; and no fp32 copy of the weights exists.
#[test]
fn full_bf16_rounds_stochastically_so_small_updates_survive() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::ones(256, DType::BF16, &dev)?)?;
    let mut opt = plain_sgd(&w, Precision::full_bf16())?;
    assert!(opt.masters().is_empty());
    for _ in 0..100 {
        opt.step(vec![Some(Tensor::ones(256, DType::BF16, &dev)?)], 1e-4)?;
    }
    let v = w.as_tensor().to_dtype(DType::F32)?;
    let mean = v.mean_all()?.to_scalar::<f32>()?;
    assert!(
        (mean - 0.99).abs() < 0.002,
        "mean {mean}, expected about 0.99"
    );
    // Each weight is a bf16 value near 0.99, not all the same one: the noise is per element.
    let distinct: std::collections::BTreeSet<u32> =
        v.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect();
    assert!(distinct.len() > 2, "{distinct:?}");
    Ok(())
}

/// Every optimizer writes bf16 weights stochastically under `full_bf16`: AdamW, Adafactor and
/// 8-bit AdamW (a tensor large enough for 8-bit moments) move sub-resolution steps on average.
#[test]
fn every_optimizer_rounds_full_bf16_weights_stochastically() -> anyhow::Result<()> {
    use ft_trainer::optim::adafactor::{Adafactor, AdafactorConfig};
    use ft_trainer::optim::adamw8bit::AdamW8bit;
    use ft_trainer::optim::AdamW;
    let dev = Device::Cpu;
    let no_decay = AdamWConfig {
        weight_decay: 0.0,
        ..Default::default()
    };
    type Make = Box<dyn Fn(usize) -> Box<dyn Optimizer>>;
    let make: [(&str, Make); 3] = [
        (
            "adamw",
            Box::new(move |n| Box::new(AdamW::new(n, no_decay))),
        ),
        (
            "adafactor",
            Box::new(|n| Box::new(Adafactor::new(n, AdafactorConfig::trainer(0.0)))),
        ),
        (
            "adamw8bit",
            Box::new(move |n| Box::new(AdamW8bit::new(n, no_decay))),
        ),
    ];
    for (name, make) in make {
        let w = Var::from_tensor(&Tensor::ones(4096, DType::BF16, &dev)?)?;
        let mut opt = MixedOptimizer::new(
            vec![("w".into(), w.clone())],
            Precision::full_bf16(),
            StatePlacement::WithModel,
            make,
            None,
        )?;
        // Steps of about 1e-4 (Adam-like updates are lr times a unit ratio), each below half a
        // bf16 step at 1.0.
        for _ in 0..100 {
            opt.step(vec![Some(Tensor::ones(4096, DType::BF16, &dev)?)], 1e-4)?;
        }
        let mean = w
            .as_tensor()
            .to_dtype(DType::F32)?
            .mean_all()?
            .to_scalar::<f32>()?;
        assert!(
            (mean - 0.99).abs() < 0.002,
            "{name}: mean {mean}, expected about 0.99"
        );
    }
    Ok(())
}

/// An f16 step with loss scaling and clipping, as `MixedOptimizer` now takes it (one read-only
/// sum of squares for the overflow check and the norm, the loss scale's inverse and the clip
/// factor folded into AdamW's read), gives the bits of unscaling to fp32 copies, clipping them,
/// then stepping.
#[test]
fn f16_step_equals_unscale_clip_then_step() -> anyhow::Result<()> {
    use ft_trainer::optim::AdamW;
    let dev = Device::Cpu;
    let shape = (48, 40);
    let weights = || -> anyhow::Result<Tensor> {
        Ok(
            (Tensor::arange(0f32, 1920.0, &dev)?.reshape(shape)? * 0.01)?
                .sin()?
                .to_dtype(DType::F16)?,
        )
    };
    let grad = |step: usize, scale: f64| -> anyhow::Result<Vec<Option<Tensor>>> {
        let g = ((Tensor::arange(0f32, 1920.0, &dev)?.reshape(shape)? * (0.3 + step as f64))?
            .cos()?
            * (0.4 * scale))?;
        Ok(vec![Some(g.to_dtype(DType::F16)?)])
    };
    let adamw = |n| -> Box<dyn Optimizer> { Box::new(AdamW::new(n, AdamWConfig::default())) };
    let w = Var::from_tensor(&weights()?)?;
    let f16 = Precision::parse("f16")?;
    let mut opt = MixedOptimizer::new(
        vec![("w".into(), w)],
        f16,
        StatePlacement::WithModel,
        adamw,
        Some(1.0),
    )?;
    let masters = [Var::from_tensor(&weights()?.to_dtype(DType::F32)?)?];
    let model = [Var::from_tensor(&weights()?)?];
    let mut reference = AdamW::new(1, AdamWConfig::default());
    let scaler = LossScaler::default();
    for step in 0..3 {
        let scale = opt.loss_scale();
        assert_eq!(scale, scaler.scale);
        let norm = opt
            .step(grad(step, scale)?, 1e-2)?
            .grad_norm
            .expect("clipping on");
        let mut g = grad(step, scale)?;
        assert!(!scaler.unscale(&mut g)?);
        let want = clip_grad_norm(&mut g, 1.0)?;
        assert!(norm > 1.0, "the step clips ({norm})");
        assert_eq!(norm.to_bits(), want.to_bits(), "step {step}: norm");
        reference.step_into(&masters, &g, 1e-2, &model)?;
        let bits = |v: &Var| -> anyhow::Result<Vec<u32>> { Ok(bits(v.as_tensor())?) };
        assert_eq!(
            bits(&opt.masters()[0])?,
            bits(&masters[0])?,
            "step {step}: masters"
        );
        assert_eq!(
            bits(&opt.params()[0])?,
            bits(&model[0])?,
            "step {step}: weights"
        );
    }
    Ok(())
}

#[test]
fn f32_models_have_no_masters() -> anyhow::Result<()> {
    let w = Var::from_tensor(&Tensor::ones(4, DType::F32, &Device::Cpu)?)?;
    let opt = MixedOptimizer::adamw(
        vec![("w".into(), w)],
        Precision::parse("f32")?,
        StatePlacement::WithModel,
        AdamWConfig::default(),
        None,
    )?;
    assert!(opt.masters().is_empty());
    assert_eq!(opt.loss_scale(), 1.0);
    assert!(Precision::parse("fp8").is_err());
    Ok(())
}

/// A bf16 model that keeps one parameter in f32 (a norm kept in full precision): that
/// parameter's master is a tensor of its own, not the parameter itself, so the step writes the
/// model from the master as for the others.
#[test]
fn an_f32_parameter_in_a_bf16_model_gets_its_own_master() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let a = Var::from_tensor(&Tensor::ones(4, DType::BF16, &dev)?)?;
    let b = Var::from_tensor(&Tensor::ones(4, DType::F32, &dev)?)?;
    let mut opt = MixedOptimizer::new(
        vec![("a".into(), a.clone()), ("b".into(), b.clone())],
        Precision::parse("bf16")?,
        StatePlacement::WithModel,
        sgd,
        None,
    )?;
    assert_eq!(opt.masters().len(), 2);
    let g = |dt| Tensor::ones(4, dt, &dev);
    opt.step(vec![Some(g(DType::BF16)?), Some(g(DType::F32)?)], 0.5)?;
    for v in [&a, &b] {
        let w = v.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?;
        assert_eq!(w, vec![0.5; 4]);
    }
    Ok(())
}

#[test]
fn f16_overflow_skips_the_step_and_backs_off() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let w = Var::from_tensor(&Tensor::ones(3, DType::F16, &dev)?)?;
    let precision = Precision::parse("f16")?;
    assert!(precision.loss_scaling && precision.master_weights);
    let mut opt = plain_sgd(&w, precision)?;
    let s0 = opt.loss_scale();
    let bad = Tensor::new(&[1f32, f32::INFINITY, 0.], &dev)?.to_dtype(DType::F16)?;
    let out = opt.step(vec![Some(bad)], 0.1)?;
    assert!(!out.applied);
    assert_eq!(opt.loss_scale(), s0 / 2.0);
    assert_eq!(
        w.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?,
        vec![1., 1., 1.]
    );
    let nan = Tensor::new(&[f32::NAN, 0., 0.], &dev)?.to_dtype(DType::F16)?;
    assert!(!opt.step(vec![Some(nan)], 0.1)?.applied);
    // A finite, scaled gradient is unscaled before the update: g = scale * 1 -> step of lr * 1.
    let scale = opt.loss_scale();
    let good = (Tensor::ones(3, DType::F32, &dev)? * scale)?.to_dtype(DType::F16)?;
    assert!(opt.step(vec![Some(good)], 0.125)?.applied);
    let w1 = w.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?;
    assert_eq!(w1, vec![0.875; 3]);
    Ok(())
}

#[test]
fn loss_scale_grows_after_a_clean_interval() {
    let mut s = LossScaler::new(1024.0);
    s.growth_interval = 3;
    s.update(false);
    s.update(false);
    assert_eq!(s.scale, 1024.0);
    s.update(false);
    assert_eq!(s.scale, 2048.0);
    s.update(true);
    assert_eq!(s.scale, 1024.0);
}

#[test]
fn clipping_scales_to_max_norm_and_reports_the_norm() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let mut g = vec![
        Some(Tensor::new(&[3f32, 0.], &dev)?),
        None,
        Some(Tensor::new(&[4f32], &dev)?),
    ];
    let n = clip_grad_norm(&mut g, 1.0)?;
    assert!((n - 5.0).abs() < 1e-6);
    assert!((global_norm(&g)? - 1.0).abs() < 1e-5);
    let before = g.clone();
    let n2 = clip_grad_norm(&mut g, 10.0)?;
    assert!(n2 < 10.0);
    let same = (before[0].as_ref().expect("g") - g[0].as_ref().expect("g"))?
        .abs()?
        .sum_all()?;
    assert_eq!(
        same.to_scalar::<f32>()?,
        0.0,
        "below the threshold nothing changes"
    );
    Ok(())
}

/// The global norm of a single micro-batch's bf16 gradients (kept in their dtype) and of strided
/// ones is exactly that of their fp32 copies, which is what the norm was computed from when the
/// gradients were always widened first; `clip_coefficient` gives clipping's factor without
/// scaling anything.
#[test]
fn norm_of_bf16_and_strided_gradients_equals_their_fp32_norm() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let a = (Tensor::randn(0f32, 3.0, (300, 70), &dev)?).to_dtype(DType::BF16)?;
    let b = Tensor::randn(0f32, 1.0, (40, 50), &dev)?.t()?;
    assert!(!b.is_contiguous());
    let low = vec![Some(a.clone()), Some(b.clone())];
    let wide = vec![Some(a.to_dtype(DType::F32)?), Some(b.contiguous()?)];
    assert_eq!(global_norm(&low)?.to_bits(), global_norm(&wide)?.to_bits());
    let (norm, coef) = ft_trainer::update::clip_coefficient(&low, 1.0)?;
    assert_eq!(norm.to_bits(), global_norm(&wide)?.to_bits());
    assert_eq!(coef, 1.0 / (norm + 1e-6));
    assert_eq!(
        ft_trainer::update::clip_coefficient(&low, 1e9)?.1,
        1.0,
        "no clipping within the bound"
    );
    assert_eq!(
        low[0].as_ref().map(|t| t.dtype()),
        Some(DType::BF16),
        "left as it was"
    );
    Ok(())
}

/// A step from one micro-batch's bf16 gradients as `MixedOptimizer` now takes it (kept in bf16,
/// clipping's factor folded into AdamW's read) gives the bits of the earlier pipeline: widen
/// every gradient to fp32, scale the copies by `clip_grad_norm`, then step.
#[test]
fn bf16_step_with_clipping_equals_widen_clip_then_step() -> anyhow::Result<()> {
    use ft_trainer::optim::AdamW;
    let dev = Device::Cpu;
    let shapes: [&[usize]; 2] = [&[64, 48], &[48]];
    let params = || -> anyhow::Result<Vec<(String, Var)>> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let t = (Tensor::arange(0f32, s.iter().product::<usize>() as f32, &dev)?
                    .reshape(*s)?
                    * (0.013 * (i + 1) as f64))?
                    .sin()?
                    .to_dtype(DType::BF16)?;
                Ok((format!("p{i}"), Var::from_tensor(&t)?))
            })
            .collect()
    };
    let grads = |step: usize| -> anyhow::Result<Vec<Option<Tensor>>> {
        shapes
            .iter()
            .map(|s| {
                let n = s.iter().product::<usize>() as f32;
                let g = ((Tensor::arange(0f32, n, &dev)?.reshape(*s)? * (0.7 + step as f64))?
                    .cos()?
                    * 3.0)?;
                Ok(Some(g.to_dtype(DType::BF16)?))
            })
            .collect()
    };
    let adamw = |n| -> Box<dyn Optimizer> { Box::new(AdamW::new(n, AdamWConfig::default())) };
    let bf16 = Precision::parse("bf16")?;
    let mut opt =
        MixedOptimizer::new(params()?, bf16, StatePlacement::WithModel, adamw, Some(1.0))?;
    let masters: Vec<Var> = params()?
        .iter()
        .map(|(_, v)| Var::from_tensor(&v.as_tensor().to_dtype(DType::F32)?))
        .collect::<candle_core::Result<_>>()?;
    let model: Vec<Var> = params()?.into_iter().map(|(_, v)| v).collect();
    let mut reference = AdamW::new(2, AdamWConfig::default());
    for step in 0..3 {
        let norm = opt
            .step(grads(step)?, 1e-2)?
            .grad_norm
            .expect("clipping on");
        let mut wide: Vec<Option<Tensor>> = grads(step)?
            .into_iter()
            .map(|g| g.map(|g| g.to_dtype(DType::F32)).transpose())
            .collect::<candle_core::Result<_>>()?;
        let want = clip_grad_norm(&mut wide, 1.0)?;
        assert!(norm > 1.0, "the step clips ({norm})");
        assert_eq!(norm.to_bits(), want.to_bits());
        reference.step_into(&masters, &wide, 1e-2, &model)?;
        for (a, b) in opt.masters().iter().zip(&masters) {
            let bits = |v: &Var| -> anyhow::Result<Vec<u32>> {
                Ok(v.as_tensor()
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|x| x.to_bits())
                    .collect())
            };
            assert_eq!(bits(a)?, bits(b)?, "step {step}");
        }
    }
    Ok(())
}
