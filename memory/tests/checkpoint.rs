//! Checkpointed backward gives the gradients of plain backprop and a lower peak.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ft_memory::alloc;
use ft_memory::checkpoint::{Checkpointer, SegmentFn};
use ft_memory::weights::{Init, ParamBuilder, ParamStore};

mod common;
use common::bits;

#[global_allocator]
static ALLOC: ft_memory::alloc::CountingAlloc = ft_memory::alloc::CountingAlloc;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Layer {
    w: Tensor,
    b: Tensor,
    params: Vec<Var>,
}

/// A deep residual MLP: `x + tanh(x W^T + b) * 0.5`, each layer one checkpoint segment.
fn stack(depth: usize, width: usize) -> anyhow::Result<(Arc<ParamStore>, Vec<Layer>)> {
    stack_of(DType::F32, depth, width)
}

fn stack_of(
    dtype: DType,
    depth: usize,
    width: usize,
) -> anyhow::Result<(Arc<ParamStore>, Vec<Layer>)> {
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), dtype, &Device::Cpu, 7);
    let mut layers = Vec::new();
    for i in 0..depth {
        let p = pb.pp(format!("layer.{i}"));
        let w = p.get(&[width, width], "weight", Init::Normal { std: 0.3 })?;
        let b = p.get(&[width], "bias", Init::Uniform { bound: 0.1 })?;
        let params = vec![Var::from_tensor(&w)?, Var::from_tensor(&b)?];
        layers.push(Layer { w, b, params });
    }
    Ok((store, layers))
}

/// The stack's trainable parameters, named `layer.param`, in order.
fn named_params(layers: &[Layer]) -> Vec<(String, Var)> {
    layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            l.params
                .iter()
                .enumerate()
                .map(move |(k, v)| (format!("{i}.{k}"), v.clone()))
        })
        .collect()
}

fn layer_fn(l: &Layer) -> SegmentFn {
    let (w, b) = (l.w.clone(), l.b.clone());
    Arc::new(move |xs: &[Tensor]| {
        let h = xs[0].matmul(&w.t()?)?.broadcast_add(&b)?.tanh()?;
        // Several temporaries per layer, as in a real block.
        let h = (h.sqr()? * 0.5)?.exp()?.log()?;
        &xs[0] + (h * 0.5)?
    })
}

fn loss_and_grads(
    layers: &[Layer],
    x: &Tensor,
    ck: &Checkpointer,
    params: &[Var],
) -> anyhow::Result<(f32, Vec<Option<Tensor>>)> {
    let mut h = x.clone();
    for l in layers {
        h = ck.run(layer_fn(l), &[&h], &l.params)?;
    }
    let loss = h.sqr()?.mean_all()?;
    let value = loss.to_scalar::<f32>()?;
    let grads = ck.gradients(&loss, params)?;
    Ok((value, grads))
}

#[test]
fn checkpointed_gradients_equal_plain_backprop_exactly() -> anyhow::Result<()> {
    let (store, layers) = stack(6, 24)?;
    let params: Vec<Var> = store.trainable()?.into_iter().map(|(_, v)| v).collect();
    let x = Tensor::randn(0f32, 1., (5, 24), &Device::Cpu)?;
    let (l0, plain) = loss_and_grads(&layers, &x, &Checkpointer::new(false), &params)?;
    let (l1, ckpt) = loss_and_grads(&layers, &x, &Checkpointer::new(true), &params)?;
    assert_eq!(l0, l1);
    assert_eq!(plain.len(), params.len());
    for (i, (a, b)) in plain.iter().zip(&ckpt).enumerate() {
        let (a, b) = (
            a.as_ref().expect("plain grad"),
            b.as_ref().expect("ckpt grad"),
        );
        let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(d, 0.0, "parameter {i} differs by {d}");
        assert!(
            a.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0,
            "parameter {i} has no gradient"
        );
    }
    Ok(())
}

#[test]
fn untracked_input_and_two_input_segments_still_reach_parameters() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 3);
    let w = pb.get(&[4, 4], "w", Init::Normal { std: 0.5 })?;
    let wv = Var::from_tensor(&w)?;
    let x = Tensor::randn(0f32, 1., (3, 4), &dev)?; // raw data: not tracked
    let ctx = Tensor::randn(0f32, 1., (3, 4), &dev)?;
    let w2 = w.clone();
    let f: SegmentFn = Arc::new(move |xs: &[Tensor]| (xs[0].matmul(&w2)? * &xs[1])?.tanh());
    let run = |enabled: bool| -> anyhow::Result<Tensor> {
        let ck = Checkpointer::new(enabled);
        let y = ck.run(f.clone(), &[&x, &ctx], std::slice::from_ref(&wv))?;
        let loss = y.sum_all()?;
        let g = ck.gradients(&loss, std::slice::from_ref(&wv))?;
        Ok(g[0].clone().expect("gradient for w"))
    };
    let (a, b) = (run(false)?, run(true)?);
    assert_eq!((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
    Ok(())
}

#[test]
fn checkpointing_lowers_the_measured_peak_on_a_deep_stack() -> anyhow::Result<()> {
    let _g = SERIAL.lock();
    let (store, layers) = stack(24, 128)?;
    let params: Vec<Var> = store.trainable()?.into_iter().map(|(_, v)| v).collect();
    let x = Tensor::randn(0f32, 1., (256, 128), &Device::Cpu)?;
    let peak = |enabled: bool| -> anyhow::Result<usize> {
        let ck = Checkpointer::new(enabled);
        let (r, p) = alloc::measure_peak(|| loss_and_grads(&layers, &x, &ck, &params));
        r?;
        Ok(p)
    };
    let plain = peak(false)?;
    let ckpt = peak(true)?;
    println!("deep stack peak: plain {plain} B, checkpointed {ckpt} B");
    // 24 layers x 6 activations of 128 KiB each (plain) versus 24 boundaries + one layer.
    assert!(
        (ckpt as f64) < 0.5 * plain as f64,
        "checkpointed peak {ckpt} not well below plain {plain}"
    );
    Ok(())
}

/// The fused backward pass (`MixedOptimizer::backward_and_step`) on a stack of checkpointed
/// layers with bf16 weights, with fp32 masters and without (`full_bf16`, stochastic rounding):
/// every layer's parameters are updated during the backward, and the weights after three steps
/// equal those of backward-then-step bit for bit. A parameter used inside a segment and outside
/// it is refused.
#[test]
fn fused_backward_updates_each_layer_during_the_backward() -> anyhow::Result<()> {
    use ft_memory::mixed::{MixedOptimizer, StatePlacement};
    use ft_memory::optim::{AdamW, AdamWConfig, Optimizer};
    use ft_memory::precision::Precision;
    let _g = SERIAL.lock();
    let adamw = |n| -> Box<dyn Optimizer> { Box::new(AdamW::new(n, AdamWConfig::default())) };
    type Run = (Vec<Vec<u32>>, usize);
    let run = |precision: Precision, fused: bool, outside: bool| -> anyhow::Result<Run> {
        let (_store, layers) = stack_of(DType::BF16, 4, 16)?;
        let named = named_params(&layers);
        let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
        let mut opt =
            MixedOptimizer::new(named, precision, StatePlacement::WithModel, adamw, None)?;
        let ck = Checkpointer::new(true);
        let mut taken = 0;
        for step in 0..3 {
            let x = (Tensor::arange(0f32, 48.0, &Device::Cpu)?.reshape((3, 16))?
                * (0.1 + step as f64))?
                .sin()?
                .to_dtype(DType::BF16)?;
            ck.begin_forward();
            let mut h = x;
            for l in &layers {
                h = ck.run(layer_fn(l), &[&h], &l.params)?;
            }
            if outside {
                // Layer 0's weight read again outside its segment.
                h = h.matmul(&layers[0].w)?;
            }
            let loss = h.to_dtype(DType::F32)?.sqr()?.mean_all()?;
            if fused {
                taken += opt.backward_and_step(&ck, &loss, 1e-2)?;
            } else {
                let grads = ck.gradients(&loss, &vars)?;
                opt.step(grads, 1e-2)?;
            }
        }
        let bits = vars
            .iter()
            .map(|v| Ok(bits(v.as_tensor())?))
            .collect::<anyhow::Result<_>>()?;
        Ok((bits, taken))
    };
    for precision in [Precision::parse("bf16")?, Precision::full_bf16()] {
        let (plain, _) = run(precision, false, false)?;
        let (fused, taken) = run(precision, true, false)?;
        assert_eq!(
            taken,
            3 * 8,
            "every parameter of every layer, in each of three steps"
        );
        assert_eq!(fused, plain, "{precision:?}");
    }
    let e = run(Precision::parse("bf16")?, true, true)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("inside a checkpointed segment and outside"),
        "{e}"
    );
    Ok(())
}

/// With clipping, the fused backward pass clips each tensor by its own norm (kohya's rule; the
/// norms of a segment's tensors are read back together): with plain SGD on f32 weights each
/// update is `-lr * min(1, max / (||g_i|| + 1e-6)) * g_i` of the plain backward's gradient, some
/// tensors clipped and some not. Checked for two steps against that formula.
#[test]
fn fused_backward_clips_each_tensor_by_its_own_norm() -> anyhow::Result<()> {
    use ft_memory::mixed::{MixedOptimizer, StatePlacement};
    use ft_memory::optim::{Optimizer, Sgd};
    use ft_memory::precision::Precision;
    let _g = SERIAL.lock();
    let (_store, layers) = stack(3, 16)?;
    let named = named_params(&layers);
    let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
    let sgd = |n| -> Box<dyn Optimizer> { Box::new(Sgd::new(n, 0.0, 0.0, false)) };
    let (lr, max) = (0.5, 0.05);
    let mut opt = MixedOptimizer::new(
        named,
        Precision::parse("f32")?,
        StatePlacement::WithModel,
        sgd,
        Some(max),
    )?;
    let ck = Checkpointer::new(true);
    let mut clipped = 0;
    for step in 0..2 {
        let x = (Tensor::arange(0f32, 64.0, &Device::Cpu)?.reshape((4, 16))?
            * (0.3 + step as f64))?
            .sin()?;
        // The plain backward's gradients at the current weights, and the weights they give.
        let (_, grads) = loss_and_grads(&layers, &x, &ck, &vars)?;
        let mut want = Vec::new();
        for (v, g) in vars.iter().zip(&grads) {
            let g = g.as_ref().ok_or_else(|| anyhow::anyhow!("no gradient"))?;
            let norm = g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            let coef = (max / (norm.sqrt() + 1e-6)).min(1.0);
            clipped += usize::from(coef < 1.0);
            want.push((v.as_tensor() - (g * (lr * coef))?)?);
        }
        ck.begin_forward();
        let mut h = x;
        for l in &layers {
            h = ck.run(layer_fn(l), &[&h], &l.params)?;
        }
        let loss = h.sqr()?.mean_all()?;
        assert_eq!(opt.backward_and_step(&ck, &loss, lr)?, vars.len());
        for (i, (v, w)) in vars.iter().zip(&want).enumerate() {
            let d = (v.as_tensor() - w)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(d < 1e-6, "step {step}, tensor {i}: off by {d}");
        }
    }
    assert!(
        clipped > 0 && clipped < 2 * vars.len(),
        "{clipped} of {} updates clipped: some should be, not all",
        2 * vars.len()
    );
    Ok(())
}

/// The early step gets each segment's gradients in one call (so per-tensor clipping reads a
/// segment's norms back once): as many calls as segments, each with that segment's parameters;
/// what it hands back is gathered as usual, so a hook that takes nothing leaves the plain
/// backward's gradients.
#[test]
fn early_step_gets_one_call_per_segment() -> anyhow::Result<()> {
    use ft_memory::checkpoint::EarlyStep;
    use std::sync::Mutex;
    let _g = SERIAL.lock();
    let (_store, layers) = stack(4, 8)?;
    let vars: Vec<Var> = named_params(&layers).into_iter().map(|(_, v)| v).collect();
    let ck = Checkpointer::new(true);
    let x = (Tensor::arange(0f32, 24.0, &Device::Cpu)?.reshape((3, 8))? * 0.2)?.sin()?;
    let (_, plain) = loss_and_grads(&layers, &x, &ck, &vars)?;
    let calls: Arc<Mutex<Vec<usize>>> = Arc::default();
    let seen = calls.clone();
    let hook: EarlyStep = Arc::new(move |grads: Vec<(Var, Tensor)>| {
        if let Ok(mut c) = seen.lock() {
            c.push(grads.len());
        }
        Ok(grads)
    });
    ck.begin_forward();
    let mut h = x;
    for l in &layers {
        h = ck.run(layer_fn(l), &[&h], &l.params)?;
    }
    let loss = h.sqr()?.mean_all()?;
    let (grads, taken) = ck.gradients_with(&loss, &vars, Some(hook))?;
    assert_eq!(taken, 0);
    let calls = calls.lock().map(|c| c.clone()).unwrap_or_default();
    assert_eq!(
        calls,
        vec![2; layers.len()],
        "one call per segment, its weight and bias"
    );
    for (g, p) in grads.iter().zip(&plain) {
        let (g, p) = (g.as_ref(), p.as_ref());
        let g = g.ok_or_else(|| anyhow::anyhow!("gradient lost"))?;
        let p = p.ok_or_else(|| anyhow::anyhow!("no plain gradient"))?;
        assert_eq!(bits(g)?, bits(p)?);
    }
    Ok(())
}
