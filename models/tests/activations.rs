//! The activation formulas of `ft_models::activations` against a real forward: per segment
//! (measured under `blocks`) and the caller's graph, exactly, for several shapes, f32 and bf16;
//! and the whole graph without segments equal to what the profile says `none` keeps.

mod common;

use candle_core::{DType, Device, Tensor};
use ft_models::activations::{T5Shape, Target, UNetShape};
use ft_models::dropout::DropoutCtx;
use ft_models::t5::{T5Batch, T5Config, T5};
use ft_models::unet::{UNet, UNetConfig};
use ft_params::checkpoint::{
    budget_keeps, graph_bytes, ActivationProfile, Checkpointer, SegmentBytes, Strategy,
};
use ft_params::{ParamBuilder, ParamStore};

/// Runs `forward` under `blocks` (measuring) and under `none`, and compares both with `want`.
fn check(
    label: &str,
    want: &ActivationProfile,
    forward: impl Fn(&Checkpointer) -> anyhow::Result<Tensor>,
) -> anyhow::Result<()> {
    let ck = Checkpointer::with_strategy(Strategy::Blocks).measuring();
    let y = forward(&ck)?;
    // What the graphs hold, and the input copies that are their leaves.
    let graphs = |s: &[SegmentBytes]| -> Vec<(u64, u64, u64, u64)> {
        s.iter()
            .map(|s| (s.graph, s.output, s.inputs, s.op_kept))
            .collect()
    };
    assert_eq!(
        graphs(&ck.measured()),
        graphs(&want.segments),
        "{label}: segments"
    );
    assert_eq!(graph_bytes(&y), want.outer, "{label}: the caller's graph");
    // Without segments the graph is everything; with every segment recomputed, only the
    // caller's graph is kept.
    // What ops keep beside the graph (`SegmentBytes::op_kept`) is counted apart.
    let op_kept: u64 = want.segments.iter().map(|s| s.op_kept).sum();
    for (s, beside) in [(Strategy::None, op_kept), (Strategy::Full, 0)] {
        let before = ft_kernels::op_kept::added();
        let y = forward(&Checkpointer::with_strategy(s))?;
        let kept = want.held(s).kept - want.op_held - beside;
        assert_eq!(graph_bytes(&y), kept, "{label}: the graph under {s}");
        if s == Strategy::None {
            let added = ft_kernels::op_kept::added() - before;
            assert_eq!(added, op_kept, "{label}: kept beside the graph under {s}");
        }
    }
    // budget:B: the run keeps the segments the plan keeps (the last that fit), from the sizes
    // it measures in its first step, which count the input copies as the plan's do.
    // Half the segments' bytes, and all of them (the first segment too, whose input may be
    // the data, which needs no gradient and is not copied).
    let sizes: Vec<u64> = want.segments.iter().map(|s| s.kept()).collect();
    let total: u64 = sizes.iter().sum();
    for b in [total / 2, total] {
        let keep = budget_keeps(&sizes, b);
        let ck = Checkpointer::with_strategy(Strategy::Budget(b));
        let y = forward(&ck)?;
        ck.gradients(&y.sum_all()?, &[])?;
        let planned: u64 = sizes
            .iter()
            .zip(&keep)
            .filter(|(_, k)| **k)
            .map(|(s, _)| s)
            .sum();
        let kept = keep.iter().filter(|k| **k).count();
        assert_eq!(
            ck.budget_plan(),
            Some((kept, sizes.len() - kept, planned)),
            "{label}: budget:{b}B"
        );
    }
    Ok(())
}

#[test]
fn unet_formulas_equal_the_graph() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let cfg = UNetConfig::from_file(&common::fixture("unet_tiny/config.json"))?;
    for dtype in [DType::F32, DType::BF16] {
        let pb = ParamBuilder::new(ParamStore::new(), dtype, &dev, 1);
        let unet = UNet::new(&pb, &cfg)?;
        for (batch, height, width, context_len) in [(1, 8, 6, 5), (2, 4, 4, 3), (1, 16, 12, 7)] {
            let shape = UNetShape {
                batch,
                height,
                width,
                context_len,
            };
            let x = Tensor::randn(0f32, 1., (batch, 4, height, width), &dev)?.to_dtype(dtype)?;
            let ctx = Tensor::randn(0f32, 1., (batch, context_len, 24), &dev)?.to_dtype(dtype)?;
            let te = Tensor::randn(0f32, 1., (batch, 12), &dev)?.to_dtype(dtype)?;
            let ids = Tensor::ones((batch, 6), dtype, &dev)?;
            let t = vec![10.0; batch];
            let want = cfg.activations(&shape, dtype, Target::Cpu);
            check(&format!("{shape:?} {dtype:?}"), &want, |ck| {
                Ok(unet.forward(&x, &t, &ctx, Some((&te, &ids)), ck)?)
            })?;
        }
    }
    Ok(())
}

fn t5_batch(shape: &T5Shape, vocab: u32) -> anyhow::Result<T5Batch> {
    let dev = Device::Cpu;
    let (b, ls, lt) = (shape.batch, shape.source_len, shape.target_len);
    let ids: Vec<u32> = (0..b * ls).map(|i| 2 + i as u32 % (vocab - 2)).collect();
    let labels: Vec<i64> = (0..b * lt).map(|i| 2 + i as i64 % 7).collect();
    Ok(T5Batch {
        input_ids: Tensor::from_vec(ids, (b, ls), &dev)?,
        attention_mask: Tensor::ones((b, ls), DType::F32, &dev)?,
        labels: Tensor::from_vec(labels, (b, lt), &dev)?,
        label_tokens: b * lt,
    })
}

#[test]
fn t5_formulas_equal_the_graph() -> anyhow::Result<()> {
    for (ff, tied, dropout) in [
        ("gated-gelu", false, 0.0),
        ("relu", true, 0.0),
        ("gated-gelu", true, 0.1),
    ] {
        let mut cfg = T5Config::tiny(20);
        cfg.feed_forward_proj = ff.into();
        cfg.tie_word_embeddings = tied;
        cfg.dropout_rate = dropout;
        for dtype in [DType::F32, DType::BF16] {
            let pb = ParamBuilder::new(ParamStore::new(), dtype, &Device::Cpu, 2);
            let m = T5::new(&pb, &cfg)?;
            let drop = if dropout > 0.0 {
                DropoutCtx::train(dropout, 7)
            } else {
                DropoutCtx::eval()
            };
            for (batch, source_len, target_len) in [(2, 5, 4), (1, 7, 3), (3, 4, 6)] {
                let shape = T5Shape {
                    batch,
                    source_len,
                    target_len,
                };
                let data = t5_batch(&shape, 20)?;
                let want = cfg.activations(&shape, dtype, Target::Cpu, true);
                check(
                    &format!("{ff} tied {tied} p {dropout} {shape:?} {dtype:?}"),
                    &want,
                    |ck| Ok(m.summed_loss(&data, &drop, ck)?),
                )?;
            }
        }
    }
    Ok(())
}

#[test]
fn fewshot_formulas_equal_the_graph() -> anyhow::Result<()> {
    use ft_models::activations::EpisodeShape;
    use ft_models::fewshot::{Backbone, BackboneKind, Episode, FewShotModel, Method};
    for (kind, size, flatten) in [
        (BackboneKind::Conv4, 20, true),
        (BackboneKind::Conv6, 17, false),
        (BackboneKind::ResNet10, 24, true),
        (BackboneKind::ResNet18, 19, false),
    ] {
        for method in [Method::FsctCosine, Method::FsctSoftmax, Method::ProtoNet] {
            for dtype in [DType::F32, DType::BF16] {
                let (n_way, k_shot, n_query) = (3, 2, 2);
                let pb = ParamBuilder::new(ParamStore::new(), dtype, &Device::Cpu, 3);
                let bb = Backbone::new(&pb, kind, size, flatten)?;
                let m = FewShotModel::new(&pb, bb, method, n_way, k_shot)?;
                let shape = EpisodeShape {
                    n_way,
                    k_shot,
                    n_query,
                    image_size: size,
                };
                let n = n_way * (k_shot + n_query);
                let ep = Episode {
                    images: Tensor::randn(0f32, 1., (n, 3, size, size), &Device::Cpu)?
                        .to_dtype(dtype)?,
                    n_way,
                    k_shot,
                    n_query,
                };
                let want = m.activations(&shape, dtype, Target::Cpu);
                check(&format!("{kind:?} {method:?} {dtype:?}"), &want, |ck| {
                    Ok(m.summed_loss(&ep, true, ck)?.0)
                })?;
            }
        }
    }
    Ok(())
}
