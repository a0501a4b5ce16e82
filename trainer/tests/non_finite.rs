//! Nothing non-finite gets in: a step whose gradient holds inf or NaN leaves the weights as they
//! were (in the fused backward pass too, tensor by tensor), a weight holding NaN is never saved,
//! a model loaded with one is refused, and the flags that would make one are refused.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use clap::Parser;
use ft_params::checkpoint::{Checkpointer, SegmentFn};
use ft_params::weights::SafetensorsFiles;
use ft_params::Init;
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer, Sgd};
use ft_trainer::scratch::Scratch;
use ft_trainer::train::{CommonArgs, SessionBuilder};
use ft_trainer::update::{GradAccumulator, MixedOptimizer, Precision, StatePlacement};

fn tmp(tag: &str) -> Scratch {
    Scratch::new(&format!("ft-nonfinite-{tag}"))
}

fn adamw(n: usize) -> Box<dyn Optimizer> {
    Box::new(AdamW::new(n, AdamWConfig::default()))
}

fn values(v: &Var) -> anyhow::Result<Vec<f32>> {
    Ok(v.as_tensor()
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

/// Without a loss scale, a NaN in any gradient skips the step: no weight moves, the outcome says
/// why. Under f16 loss scaling the same is the ordinary overflow: the scale backs off, and the
/// outcome does not call it a divergence.
#[test]
fn a_non_finite_gradient_skips_the_step() -> anyhow::Result<()> {
    for (precision, diverged) in [("f32", true), ("bf16", true), ("f16", false)] {
        let p = Precision::parse(precision)?;
        let dt = p.storage;
        let a = Var::from_tensor(&Tensor::ones(4, dt, &Device::Cpu)?)?;
        let b = Var::from_tensor(&Tensor::ones(3, dt, &Device::Cpu)?)?;
        let named = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
        let mut opt = MixedOptimizer::new(named, p, StatePlacement::WithModel, adamw, None)?;
        let before = (values(&a)?, values(&b)?);
        let nan = Tensor::new(&[1f32, f32::NAN, 0.5], &Device::Cpu)?.to_dtype(dt)?;
        let grads = vec![Some(Tensor::ones(4, dt, &Device::Cpu)?), Some(nan)];
        let out = opt.step(grads, 1e-2)?;
        assert!(!out.applied, "{precision}");
        assert_eq!(out.non_finite, diverged, "{precision}");
        assert_eq!(
            (values(&a)?, values(&b)?),
            before,
            "{precision}: weights moved"
        );
        // A finite step afterwards goes through and reports its norm.
        let grads = vec![
            Some(Tensor::ones(4, dt, &Device::Cpu)?),
            Some(Tensor::ones(3, dt, &Device::Cpu)?),
        ];
        let mut out = opt.step(grads.clone(), 1e-2)?;
        while !out.applied {
            // f16: the scale backs off until the gradients fit.
            out = opt.step(grads.clone(), 1e-2)?;
        }
        assert!(out.grad_norm.is_some_and(|n| n.is_finite()));
        assert_ne!(values(&a)?, before.0);
    }
    Ok(())
}

/// In a fused backward pass with clipping, a tensor whose gradient is NaN (d/dw sqrt(w^2) at
/// w = 0) is left as it is while the others are updated, and the outcome counts it.
#[test]
fn the_fused_backward_pass_skips_a_tensor_with_a_non_finite_gradient() -> anyhow::Result<()> {
    let store = ft_params::ParamStore::new();
    let pb = ft_params::ParamBuilder::new(store.clone(), DType::F32, &Device::Cpu, 1);
    let good = pb.get(&[4, 4], "good", Init::Normal { std: 0.5 })?;
    let bad = pb.get(&[4], "bad", Init::Zeros)?;
    let (gv, bv) = (Var::from_tensor(&good)?, Var::from_tensor(&bad)?);
    let named = vec![
        ("good".to_string(), gv.clone()),
        ("bad".to_string(), bv.clone()),
    ];
    let sgd = |n| -> Box<dyn Optimizer> { Box::new(Sgd::new(n, 0.0, 0.0, false)) };
    let mut opt = MixedOptimizer::new(
        named,
        Precision::parse("f32")?,
        StatePlacement::WithModel,
        sgd,
        Some(1.0),
    )?;
    let ck = Checkpointer::new(true);
    let f1: SegmentFn = {
        let w = good.clone();
        Arc::new(move |xs: &[Tensor]| xs[0].matmul(&w)?.tanh())
    };
    let f2: SegmentFn = {
        let w = bad.clone();
        Arc::new(move |xs: &[Tensor]| xs[0].broadcast_add(&w.sqr()?.sqrt()?))
    };
    let before = (values(&gv)?, values(&bv)?);
    ck.begin_forward();
    let x = Tensor::arange(0f32, 8.0, &Device::Cpu)?.reshape((2, 4))?;
    let h = ck.run(f1, &[&x], std::slice::from_ref(&gv))?;
    let h = ck.run(f2, &[&h], std::slice::from_ref(&bv))?;
    let loss = h.sqr()?.mean_all()?;
    assert!(loss.to_scalar::<f32>()?.is_finite(), "the loss is finite");
    let out = opt.backward_and_step(&ck, &loss, 0.1, &mut GradAccumulator::new())?;
    assert_eq!(out.non_finite, 1);
    assert_eq!(values(&bv)?, before.1, "the NaN-gradient tensor moved");
    assert_ne!(values(&gv)?, before.0, "the finite one must be updated");
    Ok(())
}

/// A weight holding NaN is found by name in the model and in the masters, which is what keeps
/// it out of checkpoints (`save_checkpoint` refuses).
#[test]
fn a_non_finite_weight_is_found_by_name() -> anyhow::Result<()> {
    let a = Var::from_tensor(&Tensor::ones(4, DType::BF16, &Device::Cpu)?)?;
    let b = Var::from_tensor(&Tensor::ones(3, DType::BF16, &Device::Cpu)?)?;
    let named = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
    let opt = MixedOptimizer::new(
        named,
        Precision::parse("bf16")?,
        StatePlacement::WithModel,
        adamw,
        None,
    )?;
    assert_eq!(opt.non_finite_weight()?, None);
    let inf = Tensor::new(&[1f32, f32::INFINITY, 1.0], &Device::Cpu)?;
    opt.masters()[1].set(&inf)?;
    assert_eq!(opt.non_finite_weight()?.as_deref(), Some("b"), "a master");
    b.set(&inf.to_dtype(DType::BF16)?)?;
    assert_eq!(opt.non_finite_weight()?.as_deref(), Some("b"));
    Ok(())
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
}

/// A model whose weights hold NaN is refused when it is loaded, naming the tensor and the file.
#[test]
fn a_model_with_nan_weights_is_refused_at_load() -> anyhow::Result<()> {
    let dir = tmp("load");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("model.safetensors");
    let w = Tensor::new(&[0.5f32, f32::NAN, 1.0, 2.0], &Device::Cpu)?.reshape((2, 2))?;
    let ok = Tensor::ones((2, 2), DType::F32, &Device::Cpu)?;
    ft_params::fs::save_safetensors(&[("ok.weight".into(), ok), ("bad.weight".into(), w)], &file)?;
    let out = dir.join("out").display().to_string();
    let common = Cli::parse_from(["t", "--output-dir", &out, "--quiet"]).common;
    let mut s = SessionBuilder::new(&common)?;
    let pb = s.params(Some(SafetensorsFiles::open(std::slice::from_ref(&file))?));
    pb.get(&[2, 2], "ok.weight", Init::Zeros)?;
    pb.get(&[2, 2], "bad.weight", Init::Zeros)?;
    let e = s.loaded().unwrap_err().to_string();
    assert!(
        e.contains("bad.weight") && e.contains("model.safetensors") && e.contains("NaN"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// `--weight-decay NaN` and `--max-grad-norm NaN` (and negative or infinite values) are refused
/// with the flag's name.
#[test]
fn non_finite_flags_are_refused() {
    for (flag, value) in [
        ("--weight-decay", "NaN"),
        ("--weight-decay", "-1"),
        ("--weight-decay", "inf"),
        ("--max-grad-norm", "NaN"),
        ("--max-grad-norm", "inf"),
        ("--lr", "NaN"),
    ] {
        let e = Cli::parse_from(["t".to_string(), format!("{flag}={value}")])
            .common
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains(flag), "{flag} {value}: {e}");
    }
}
