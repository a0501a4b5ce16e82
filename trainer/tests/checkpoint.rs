//! Checkpointing lowers the measured peak; a fused backward pass updates each checkpointed
//! layer during the backward, exactly as backward-then-step would.

use candle_core::{DType, Device, Tensor, Var};
use ft_params::checkpoint::{Checkpointer, EarlyStep, Strategy};
use ft_trainer::ledger::alloc;
use ft_trainer::update::GradAccumulator;

mod common;
use common::{bits, layer_fn, loss_and_grads, named_params, stack, stack_of};

use ft_trainer::ledger::alloc::alone;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn checkpointing_lowers_the_measured_peak_on_a_deep_stack() -> anyhow::Result<()> {
    alone(&SERIAL, || {
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
    })
}

/// Block-wise backward frees as it goes: on a deep stack (24 segments), live heap bytes during
/// the backward never rise above the level at the end of forward plus the parameter gradients
/// produced so far plus one segment's backward working set (bounded here by twice its graph),
/// and each segment's graph is gone once its backward has run (probed from the early-step hook,
/// which sees the live bytes as each segment finishes: they fall by a segment each time).
#[test]
fn blockwise_backward_frees_each_segment_as_it_goes() -> anyhow::Result<()> {
    use std::sync::{Arc, Mutex};
    alone(&SERIAL, || {
        let depth = 24;
        let (store, layers) = stack(depth, 128)?;
        let params: Vec<Var> = store.trainable()?.into_iter().map(|(_, v)| v).collect();
        let x = Tensor::randn(0f32, 1., (256, 128), &Device::Cpu)?;
        let grad_bytes_per_layer = (128 * 128 + 128) * 4;
        // Returns (live at the end of forward, backward peak above it, live at each probe above it).
        let run = |s: Strategy| -> anyhow::Result<(usize, usize, Vec<isize>)> {
            let ck = Checkpointer::with_strategy(s);
            ck.begin_forward();
            let base = alloc::live_bytes();
            let mut h = x.clone();
            for l in &layers {
                h = ck.run(layer_fn(l), &[&h], &l.params)?;
            }
            let loss = h.sqr()?.mean_all()?;
            drop(h);
            let end_forward = alloc::live_bytes();
            let probes: Arc<Mutex<Vec<isize>>> = Arc::default();
            let seen = probes.clone();
            let hook: EarlyStep = Arc::new(move |grads: Vec<(Var, Tensor)>| {
                if let Ok(mut p) = seen.lock() {
                    p.push(alloc::live_bytes() as isize - end_forward as isize);
                }
                Ok(grads) // takes nothing: a probe
            });
            alloc::reset_peak();
            let (grads, _) = ck.gradients_with(&loss, &params, Some(hook))?;
            let peak = alloc::peak_bytes() - end_forward;
            assert!(grads.iter().all(|g| g.is_some()));
            drop(grads);
            let p = probes.lock().map(|p| p.clone()).unwrap_or_default();
            Ok((end_forward - base, peak, p))
        };
        // The allocations that persist (matmul packing buffers per thread, on every rayon thread
        // however many the machine has) are made before measuring, then a first pass warms the rest.
        ft_trainer::ledger::measure::warm_matmul_scratch();
        run(Strategy::None)?;
        let (fwd_blocks, peak_blocks, probes) = run(Strategy::Blocks)?;
        let (fwd_plain, peak_plain, _) = run(Strategy::None)?;
        let (fwd_full, peak_full, _) = run(Strategy::Full)?;
        let segment = fwd_blocks / depth;
        println!(
        "deep stack: end of forward / backward peak above it: none {fwd_plain} / {peak_plain} B, \
         blocks {fwd_blocks} / {peak_blocks} B, full {fwd_full} / {peak_full} B; one segment \
         {segment} B; live above end of forward at each segment's end: {probes:?}"
    );
        assert_eq!(probes.len(), depth, "one probe per segment");
        let all_grads = depth * grad_bytes_per_layer;
        let working = 2 * segment;
        assert!(
            peak_blocks <= all_grads + working,
            "blocks: backward peak {peak_blocks} B above the end of forward, more than the \
         gradients ({all_grads} B) and one segment's working set ({working} B)"
        );
        for (k, live) in probes.iter().enumerate() {
            // At the k-th segment's end, the k segments above it have been freed (each graph
            // minus the leaf it hands on, so 0.8 of one); its own graph and backward temporaries
            // are still alive.
            let freed = (k * segment * 4 / 5) as isize;
            let bound = ((k + 1) * grad_bytes_per_layer + working) as isize - freed;
            assert!(
            *live <= bound,
            "blocks: {live} B above the end of forward at segment {k} from the top, bound {bound}"
        );
        }
        // Plain backprop frees nothing until it returns: its graph is all the activations.
        assert!(fwd_plain > depth * segment / 2, "plain {fwd_plain} B");
        assert!(peak_plain > 0);
        // Full recompute keeps only boundaries in forward.
        assert!(
            fwd_full * 2 < fwd_blocks,
            "full {fwd_full} B, blocks {fwd_blocks} B"
        );
        Ok(())
    })
}

/// The fused backward pass (`MixedOptimizer::backward_and_step`) on a stack of checkpointed
/// layers with bf16 weights, with fp32 masters and without (`full_bf16`, stochastic rounding):
/// every layer's parameters are updated during the backward, and the weights after three steps
/// equal those of backward-then-step bit for bit. A parameter used inside a segment and outside
/// it is refused.
#[test]
fn fused_backward_updates_each_layer_during_the_backward() -> anyhow::Result<()> {
    use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer};
    use ft_trainer::update::{MixedOptimizer, Precision, StatePlacement};
    alone(&SERIAL, || {
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
                    taken += opt
                        .backward_and_step(&ck, &loss, 1e-2, &mut GradAccumulator::new())?
                        .updated_in_backward;
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
    })
}

/// With clipping, the fused backward pass clips each tensor by its own norm (kohya's rule; the
/// norms of a segment's tensors are read back together): with plain SGD on f32 weights each
/// update is `-lr * min(1, max / (||g_i|| + 1e-6)) * g_i` of the plain backward's gradient, some
/// tensors clipped and some not. Checked for two steps against that formula.
#[test]
fn fused_backward_clips_each_tensor_by_its_own_norm() -> anyhow::Result<()> {
    use ft_trainer::optim::{Optimizer, Sgd};
    use ft_trainer::update::{MixedOptimizer, Precision, StatePlacement};
    alone(&SERIAL, || {
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
            assert_eq!(
                opt.backward_and_step(&ck, &loss, lr, &mut GradAccumulator::new())?
                    .updated_in_backward,
                vars.len()
            );
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
    })
}

/// Under `--fused-backward --accum N`, a micro-batch before the last holds no more than one
/// segment's gradients beside the step's sums: each segment's are added into the sums as its
/// backward ends. Measured with the counting allocator on a 24-layer stack whose parameters
/// outweigh its activations (4 rows): above its start, the second micro-batch's backward peaks
/// at most at 8 layers' gradients (a third of the model's), where plain accumulation's reaches
/// at least three quarters of the model's gradients.
#[test]
fn fused_accumulation_holds_one_segments_gradients_beside_the_sums() -> anyhow::Result<()> {
    use ft_trainer::optim::{Optimizer, Sgd};
    use ft_trainer::update::{MixedOptimizer, Precision, StatePlacement};
    alone(&SERIAL, || {
        let depth = 24;
        let (store, layers) = stack(depth, 128)?;
        let named = store.trainable()?;
        let params: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
        let grad_bytes_per_layer = (128 * 128 + 128) * 4;
        let model_grads = depth * grad_bytes_per_layer;
        let sgd = |n| -> Box<dyn Optimizer> { Box::new(Sgd::new(n, 0.0, 0.0, false)) };
        let opt = MixedOptimizer::new(
            named,
            Precision::parse("f32")?,
            StatePlacement::WithModel,
            sgd,
            None,
        )?;
        let ck = Checkpointer::with_strategy(Strategy::Blocks);
        let loss = |micro: usize| -> anyhow::Result<Tensor> {
            let x = (Tensor::arange(0f32, 512.0, &Device::Cpu)?.reshape((4, 128))?
                * (0.01 + micro as f64))?
                .sin()?;
            ck.begin_forward();
            let mut h = x;
            for l in &layers {
                h = ck.run(layer_fn(l), &[&h], &l.params)?;
            }
            Ok(h.sqr()?.mean_all()?)
        };
        // The second micro-batch's backward peak above its start, the first's sums held.
        let peak = |fused: bool| -> anyhow::Result<usize> {
            let mut acc = GradAccumulator::new();
            for micro in 0..2 {
                let l = loss(micro)?;
                let (r, p) = alloc::measure_peak(|| -> anyhow::Result<()> {
                    if fused {
                        opt.backward_and_accumulate(&ck, &l, &mut acc)?;
                    } else {
                        acc.add(ck.gradients(&l, &params)?)?;
                    }
                    Ok(())
                });
                r?;
                if micro == 1 {
                    assert_eq!(acc.micro_batches(), 2);
                    assert_eq!(acc.bytes() as usize, model_grads);
                    return Ok(p);
                }
            }
            unreachable!()
        };
        let plain = peak(false)?;
        let fused = peak(true)?;
        // Recorded in docs/benchmarks.md (run with --nocapture).
        eprintln!(
        "second micro-batch's backward, heap peak above its start: plain accumulation {plain} B, \
         fused {fused} B (model gradients {model_grads} B)"
    );
        // Plain: the gradients pile up while the graph (a fifth of their size here) is freed.
        assert!(
            plain >= model_grads * 3 / 4,
            "plain {plain} B, gradients {model_grads} B"
        );
        // Fused: one segment's backward working set (its parameter gradients, candle's zeroed
        // copies of them and its activations' gradients, 365 KB measured) beside the sums, which
        // replace the first micro-batch's gradients tensor by tensor.
        assert!(
            fused <= 8 * grad_bytes_per_layer,
            "fused {fused} B above the start, one layer's gradients {grad_bytes_per_layer} B, \
         plain {plain} B"
        );
        Ok(())
    })
}
