//! Checkpointed backward gives the gradients of plain backprop; the early step of a fused
//! backward pass gets each segment's gradients at once.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ft_params::checkpoint::{Checkpointer, SegmentFn, Strategy};
use ft_params::{Init, ParamBuilder, ParamStore};

mod common;
use common::{bits, layer_fn, loss_and_grads, named_params, stack};

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

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

/// Every strategy gives plain backprop's loss and gradients bit for bit, over three steps (the
/// budget strategy measures in the first and follows its plan after), and the budget plan keeps
/// what fits: everything under a large budget, nothing under a tiny one, part under half.
#[test]
fn every_strategy_gives_the_plain_gradients_bit_for_bit() -> anyhow::Result<()> {
    let (store, layers) = stack(6, 24)?;
    let params: Vec<Var> = store.trainable()?.into_iter().map(|(_, v)| v).collect();
    let x = Tensor::randn(0f32, 1., (5, 24), &Device::Cpu)?;
    let grads_of = |ck: &Checkpointer| -> anyhow::Result<(f32, Vec<Vec<u32>>)> {
        ck.begin_forward();
        let (l, g) = loss_and_grads(&layers, &x, ck, &params)?;
        let g = g
            .iter()
            .map(|g| bits(g.as_ref().expect("a gradient for every parameter")))
            .collect::<candle_core::Result<_>>()?;
        Ok((l, g))
    };
    let plain = grads_of(&Checkpointer::new(false))?;
    // One layer's graph: the budget's unit.
    let one = {
        let ck = Checkpointer::with_strategy(Strategy::Budget(u64::MAX));
        grads_of(&ck)?;
        ck.budget_plan().expect("a plan after the first backward").2 / layers.len() as u64
    };
    for s in [
        "blocks",
        "full",
        "full-host",
        "every:2",
        "every:4",
        "budget:1",
    ]
    .into_iter()
    .map(|s| s.parse::<Strategy>().expect("strategy"))
    .chain([Strategy::Budget(u64::MAX), Strategy::Budget(3 * one)])
    {
        let ck = Checkpointer::with_strategy(s);
        for step in 0..3 {
            assert!(
                grads_of(&ck)? == plain,
                "{s}, step {step}: not plain backprop's"
            );
        }
        if let Strategy::Budget(b) = s {
            let (kept, recomputed, bytes) = ck.budget_plan().expect("a plan");
            assert_eq!(kept + recomputed, layers.len());
            assert!(bytes <= b, "{s}: keeps {bytes} B");
            let expect_kept = match b {
                1 => 0,
                u64::MAX => layers.len(),
                _ => 3,
            };
            assert_eq!(kept, expect_kept, "{s}: keeps {kept} segments");
        }
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
    let run = |s: &str| -> anyhow::Result<Tensor> {
        let ck = Checkpointer::with_strategy(s.parse().map_err(anyhow::Error::msg)?);
        let y = ck.run(f.clone(), &[&x, &ctx], std::slice::from_ref(&wv))?;
        let loss = y.sum_all()?;
        let g = ck.gradients(&loss, std::slice::from_ref(&wv))?;
        Ok(g[0].clone().expect("gradient for w"))
    };
    let plain = run("none")?;
    for s in ["full", "blocks", "every:2"] {
        let d = (&plain - run(s)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(d, 0.0, "{s}");
    }
    Ok(())
}

/// The early step gets each segment's gradients in one call (so per-tensor clipping reads a
/// segment's norms back once): as many calls as segments, each with that segment's parameters;
/// what it hands back is gathered as usual, so a hook that takes nothing leaves the plain
/// backward's gradients.
#[test]
fn early_step_gets_one_call_per_segment() -> anyhow::Result<()> {
    use ft_params::checkpoint::EarlyStep;
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

/// `full-host` holds the tensors between segments in host memory: on the CPU as buffers of
/// their own (the model's copy and the host copy are distinct), counted by `host_bytes` during
/// the forward (the first input and every segment's output) and released by the backward.
#[test]
fn full_host_keeps_the_boundaries_in_buffers_of_their_own() -> anyhow::Result<()> {
    let (store, layers) = stack(4, 8)?;
    let params: Vec<Var> = store.trainable()?.into_iter().map(|(_, v)| v).collect();
    let x = Tensor::randn(0f32, 1., (3, 8), &Device::Cpu)?;
    let ck = Checkpointer::with_strategy(Strategy::FullHost);
    ck.begin_forward();
    let mut h = x.clone();
    let mut outputs = Vec::new();
    for l in &layers {
        h = ck.run(common::layer_fn(l), &[&h], &l.params)?;
        outputs.push(h.clone());
    }
    let one = (3 * 8 * 4) as u64;
    assert_eq!(ck.host_bytes(), (1 + layers.len() as u64) * one);
    // What the model holds is not the host copy: the segment op's output behind it (the
    // first node of its shape below it in the graph) is another buffer.
    for o in &outputs {
        let (s, _) = o.storage_and_layout();
        let nodes = o.sorted_nodes();
        let host = nodes
            .iter()
            .find(|n| n.id() != o.id() && n.dims() == o.dims() && !n.is_variable())
            .expect("the host tensor behind the model's output");
        let (t, _) = host.storage_and_layout();
        assert!(!std::ptr::eq(&*s, &*t), "one buffer for both");
    }
    let loss = h.sqr()?.mean_all()?;
    // The graph reaches the segments through their host outputs: none of the tensors handed
    // to the model between segments is kept by it (under `full` every one of them is).
    let kept: std::collections::HashSet<_> = loss.sorted_nodes().iter().map(|n| n.id()).collect();
    let inner = &outputs[..outputs.len() - 1];
    assert!(inner.iter().all(|o| !kept.contains(&o.id())));
    drop(outputs);
    drop(h);
    let grads = ck.gradients(&loss, &params)?;
    assert!(grads.iter().all(|g| g.is_some()));
    assert_eq!(ck.host_bytes(), 0, "released by the backward");
    Ok(())
}

/// A tensor every `full-host` segment reads (as T5's decoder blocks read the encoder output) is
/// copied to the host once, and its gradient, summed over the segments, is `full`'s bit for bit.
#[test]
fn full_host_copies_a_shared_input_once() -> anyhow::Result<()> {
    let (store, layers) = stack(4, 8)?;
    let mut params: Vec<Var> = store.trainable()?.into_iter().map(|(_, v)| v).collect();
    let shared = Var::from_tensor(&Tensor::randn(0f32, 1., (3, 8), &Device::Cpu)?)?;
    params.push(shared.clone());
    let x = Tensor::randn(0f32, 1., (3, 8), &Device::Cpu)?;
    let run = |s: Strategy| -> anyhow::Result<(u64, Vec<Vec<u32>>)> {
        let ck = Checkpointer::with_strategy(s);
        ck.begin_forward();
        let mut h = x.clone();
        for l in &layers {
            let layer = common::layer_fn(l);
            let f: ft_params::checkpoint::SegmentFn =
                std::sync::Arc::new(move |xs: &[Tensor]| layer(&xs[..1])? + (&xs[1] * 0.5)?);
            h = ck.run(f, &[&h, shared.as_tensor()], &l.params)?;
        }
        let host = ck.host_bytes();
        let loss = h.sqr()?.mean_all()?;
        let grads = ck.gradients(&loss, &params)?;
        let bits = grads
            .iter()
            .map(|g| bits(g.as_ref().expect("a gradient")))
            .collect::<candle_core::Result<_>>()?;
        Ok((host, bits))
    };
    let (host, on_host) = run(Strategy::FullHost)?;
    let (_, full) = run(Strategy::Full)?;
    let one = (3 * 8 * 4) as u64;
    assert_eq!(
        host,
        (2 + layers.len() as u64) * one,
        "x, shared, each output"
    );
    assert!(on_host == full, "full-host's gradients are not full's");
    Ok(())
}

/// `Checkpointer::inference`: the plain forward's values bit for bit, with no graph behind the
/// output, where the plain forward keeps every segment's (what an evaluation would hold).
#[test]
fn inference_gives_the_plain_values_and_keeps_no_graph() -> anyhow::Result<()> {
    use ft_params::checkpoint::graph_bytes;
    let (_store, layers) = stack(6, 24)?;
    let x = Tensor::randn(0f32, 1., (5, 24), &Device::Cpu)?;
    let forward = |ck: &Checkpointer| -> anyhow::Result<Tensor> {
        let mut h = x.clone();
        for l in &layers {
            h = ck.run(layer_fn(l), &[&h], &l.params)?;
        }
        Ok(h)
    };
    let plain = forward(&Checkpointer::new(false))?;
    let ours = forward(&Checkpointer::inference())?;
    assert_eq!(bits(&ours)?, bits(&plain)?);
    assert!(!ours.track_op(), "the output has a graph");
    // `cut`, for ops between segments: detached under inference only.
    assert!(!Checkpointer::inference().cut(plain.clone()).track_op());
    assert!(Checkpointer::new(false).cut(plain.clone()).track_op());
    assert_eq!(graph_bytes(&ours), 0);
    // Each layer keeps about seven tensors of the activations' size: six layers' worth.
    assert!(
        graph_bytes(&plain) >= 6 * 5 * 24 * 4,
        "{}",
        graph_bytes(&plain)
    );
    Ok(())
}

/// A parameter read by one of the ops that hand their gradients to `ft_kernels::grad_tap`,
/// inside a segment and again after it: the sum is plain backprop's, bit for bit (the outer
/// op's gradient first, then the segment's, as candle's store adds them), and an early step is
/// still refused. The outer op's backward runs before the segment's and its gradient waits in
/// the tap; a segment that took what the tap held for its parameters would have handed that
/// on as its own, and the refusal would have depended on the order of the backward.
#[test]
fn a_tapped_parameter_used_outside_its_segment_sums_and_is_refused_early() -> anyhow::Result<()> {
    use ft_kernels::linear::linear;
    use ft_params::checkpoint::EarlyStep;
    let _g = SERIAL.lock();
    let dev = Device::Cpu;
    let w = Var::from_tensor(&(Tensor::arange(0f32, 64.0, &dev)?.reshape((8, 8))? * 0.05)?.cos()?)?;
    let b = Var::from_tensor(&(Tensor::arange(0f32, 8.0, &dev)? * 0.1)?.sin()?)?;
    let x = (Tensor::arange(0f32, 24.0, &dev)?.reshape((3, 8))? * 0.2)?.sin()?;
    let vars = vec![w.clone(), b.clone()];
    let (wt, bt) = (w.as_tensor().clone(), b.as_tensor().clone());
    let seg: SegmentFn = Arc::new(move |xs: &[Tensor]| linear(&xs[0], &wt, Some(&bt))?.tanh());
    let forward = |ck: Option<&Checkpointer>| -> anyhow::Result<Tensor> {
        let h = match ck {
            Some(ck) => {
                ck.begin_forward();
                ck.run(seg.clone(), &[&x], &vars)?
            }
            None => seg(std::slice::from_ref(&x))?,
        };
        Ok(linear(&h, w.as_tensor(), None)?.sqr()?.mean_all()?)
    };
    let plain = forward(None)?.backward()?;
    let ck = Checkpointer::new(true);
    let grads = ck.gradients(&forward(Some(&ck))?, &vars)?;
    for (g, v) in grads.iter().zip(&vars) {
        let g = g.as_ref().ok_or_else(|| anyhow::anyhow!("gradient lost"))?;
        let want = plain
            .get(v.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no plain gradient"))?;
        assert_eq!(bits(g)?, bits(want)?);
    }
    // An early step taking everything it is offered: `w`'s gradient from its segment alone
    // would be incomplete.
    let hook: EarlyStep = Arc::new(|_grads: Vec<(Var, Tensor)>| Ok(Vec::new()));
    let err = ck
        .gradients_with(&forward(Some(&ck))?, &vars, Some(hook))
        .expect_err("a parameter used inside and outside a segment under an early step");
    assert!(
        err.to_string()
            .contains("inside a checkpointed segment and outside"),
        "{err}"
    );
    Ok(())
}
