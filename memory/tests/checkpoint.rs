//! Checkpointed backward gives the gradients of plain backprop and a lower peak.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ft_memory::alloc;
use ft_memory::checkpoint::{Checkpointer, SegmentFn};
use ft_memory::weights::{Init, ParamBuilder, ParamStore};

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
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &Device::Cpu, 7);
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
