//! Few-shot models: every trainable parameter gets a nonzero gradient, shapes and names are
//! right, batch norm keeps running statistics, and FSCT's cosine attention is bounded.

use candle_core::{DType, Device, Tensor, Var};
use ft_models::fewshot::{Backbone, BackboneKind, Episode, FewShotModel, Method};
use ft_params::checkpoint::Checkpointer;
use ft_params::{ParamBuilder, ParamStore};

/// A built model, its trainable parameters and its store.
type Built = (FewShotModel, Vec<(String, Var)>, std::sync::Arc<ParamStore>);

fn build(kind: BackboneKind, method: Method, size: usize, flatten: bool) -> anyhow::Result<Built> {
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &Device::Cpu, 11);
    let bb = Backbone::new(&pb, kind, size, flatten)?;
    let m = FewShotModel::new(&pb, bb, method, 3, 2)?;
    let params = store.trainable()?;
    Ok((m, params, store))
}

fn episode(size: usize, seed: u64) -> anyhow::Result<Episode> {
    let images =
        ft_kernels::gradcheck::random_tensor(&[3 * (2 + 2), 3, size, size], seed, &Device::Cpu)?
            .to_dtype(DType::F32)?;
    Ok(Episode {
        images,
        n_way: 3,
        k_shot: 2,
        n_query: 2,
    })
}

#[test]
fn every_parameter_gets_a_gradient_for_each_method_and_backbone() -> anyhow::Result<()> {
    for (kind, size, flatten) in [
        (BackboneKind::Conv4, 32, true),
        (BackboneKind::Conv6, 32, false),
        (BackboneKind::ResNet10, 32, true),
        (BackboneKind::ResNet18, 32, false),
    ] {
        for method in [Method::FsctCosine, Method::FsctSoftmax, Method::ProtoNet] {
            let (m, params, _) = build(kind, method, size, flatten)?;
            let (loss, correct) =
                m.summed_loss(&episode(size, 1)?, true, &Checkpointer::default())?;
            assert!(correct <= 6);
            let g = loss.backward()?;
            for (name, v) in &params {
                // A bias added to every class's score shifts all logits equally: cross-entropy's
                // gradient for it is exactly zero (in the reference too).
                if method == Method::FsctSoftmax && name == "linear.2.bias" {
                    continue;
                }
                let s = g
                    .get(v.as_tensor())
                    .map(|t| {
                        t.abs()
                            .and_then(|a| a.sum_all())
                            .and_then(|s| s.to_scalar::<f32>())
                    })
                    .transpose()?
                    .unwrap_or(0.0);
                assert!(s > 0.0, "{kind:?} {method:?}: `{name}` has no gradient");
            }
        }
    }
    Ok(())
}

/// The backbone's blocks as checkpoint segments: under every strategy each parameter's
/// gradient is plain backprop's bit for bit (CPU f32), and the running statistics move once per
/// training forward, as in plain backprop, however often backward recomputes a block.
#[test]
fn every_checkpointing_strategy_gives_plain_backprops_gradients() -> anyhow::Result<()> {
    use ft_params::checkpoint::Strategy;
    for kind in [BackboneKind::Conv4, BackboneKind::ResNet10] {
        let mut plain: Option<(Vec<Option<Tensor>>, Vec<f32>)> = None;
        for strategy in [
            Strategy::None,
            Strategy::Blocks,
            Strategy::Full,
            Strategy::FullHost,
            Strategy::Every(2),
        ] {
            let (m, params, store) = build(kind, Method::FsctCosine, 32, true)?;
            let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
            let ck = Checkpointer::with_strategy(strategy);
            let (loss, _) = m.summed_loss(&episode(32, 1)?, true, &ck)?;
            let grads = ck.gradients(&loss, &vars)?;
            let stats: Vec<f32> = store
                .frozen()
                .iter()
                .map(|(_, t)| t.flatten_all()?.to_vec1::<f32>())
                .collect::<candle_core::Result<Vec<_>>>()?
                .concat();
            let Some((g0, s0)) = &plain else {
                plain = Some((grads, stats));
                continue;
            };
            assert!(
                &stats == s0,
                "{kind:?} {strategy}: running statistics differ"
            );
            for ((name, _), (a, b)) in params.iter().zip(g0.iter().zip(&grads)) {
                let (Some(a), Some(b)) = (a, b) else {
                    anyhow::bail!("{kind:?} {strategy}: `{name}` has no gradient");
                };
                let (a, b) = (
                    a.flatten_all()?.to_vec1::<f32>()?,
                    b.flatten_all()?.to_vec1::<f32>()?,
                );
                assert!(
                    a == b,
                    "{kind:?} {strategy}: `{name}` differs from plain backprop"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn names_and_feature_sizes_follow_the_reference() -> anyhow::Result<()> {
    let (m, params, store) = build(BackboneKind::Conv4, Method::FsctCosine, 84, true)?;
    assert_eq!(
        m.backbone.feat_dim,
        64 * 5 * 5,
        "Conv4 at 84 px flattens to 1600"
    );
    let names: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
    for n in [
        "feature.trunk.0.C.weight",
        "feature.trunk.3.BN.bias",
        "proto_weight",
        "ATTN.input_linear.1.weight",
        "FFN.3.bias",
        "linear.2.L.weight_v",
        "linear.2.L.weight_g",
    ] {
        assert!(names.contains(&n), "missing {n}");
    }
    let frozen: Vec<String> = store.frozen().into_iter().map(|(n, _)| n).collect();
    assert!(frozen.contains(&"feature.trunk.0.BN.running_mean".to_string()));
    let (r, _, _) = build(BackboneKind::ResNet18, Method::ProtoNet, 224, true)?;
    assert_eq!(r.backbone.feat_dim, 512 * 7 * 7);
    // Sizes that are not multiples of 32 round up at each stride (72 -> 36, 18, 9, 5, 3).
    let (r, _, _) = build(BackboneKind::ResNet10, Method::ProtoNet, 72, true)?;
    let x = ft_kernels::gradcheck::random_tensor(&[1, 3, 72, 72], 1, &Device::Cpu)?
        .to_dtype(DType::F32)?;
    assert_eq!(
        r.backbone
            .forward(&x, false, &Checkpointer::default())?
            .dims(),
        &[1, r.backbone.feat_dim]
    );
    assert_eq!(r.backbone.feat_dim, 512 * 3 * 3);
    assert!("resnet50".parse::<BackboneKind>().is_err());
    assert!("matchingnet".parse::<Method>().is_err());
    Ok(())
}

#[test]
fn batch_norm_running_statistics_move_in_training_only() -> anyhow::Result<()> {
    let (m, _, store) = build(BackboneKind::Conv4, Method::ProtoNet, 32, true)?;
    let rm = || {
        store
            .get("feature.trunk.0.BN.running_mean")
            .expect("buffer")
            .sum_all()?
            .to_scalar::<f32>()
    };
    let before = rm()?;
    m.scores(&episode(32, 2)?, false, &Checkpointer::default())?;
    assert_eq!(rm()?, before, "evaluation leaves running stats alone");
    m.scores(&episode(32, 2)?, true, &Checkpointer::default())?;
    assert_ne!(rm()?, before, "training updates them");
    // Eval output is deterministic and per-sample (no batch statistics).
    let ep = episode(32, 3)?;
    let a = m.scores(&ep, false, &Checkpointer::default())?;
    let b = m.scores(&ep, false, &Checkpointer::default())?;
    assert_eq!((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
    Ok(())
}

#[test]
fn protonet_scores_are_negative_squared_distances() -> anyhow::Result<()> {
    let (m, _, _) = build(BackboneKind::Conv4, Method::ProtoNet, 32, true)?;
    let ep = episode(32, 4)?;
    let s = m.scores(&ep, false, &Checkpointer::default())?;
    assert_eq!(s.dims(), &[6, 3]);
    assert!(s.max_all()?.to_scalar::<f32>()? <= 0.0);
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu)?;
    Ok(())
}

#[test]
fn evaluation_without_a_graph_gives_the_evaluation_loss() -> anyhow::Result<()> {
    for (kind, method) in [
        (BackboneKind::Conv4, Method::FsctCosine),
        (BackboneKind::ResNet10, Method::ProtoNet),
    ] {
        let (m, _, store) = build(kind, method, 32, false)?;
        let ep = episode(32, 5)?;
        // Running statistics away from their start, as after training.
        m.scores(&ep, true, &Checkpointer::default())?;
        let (_, stats) = store
            .all()
            .into_iter()
            .find(|(n, _)| n.ends_with("running_mean"))
            .expect("a batch norm");
        let before = stats.sum_all()?.to_scalar::<f32>()?;
        let (want, right) = m.summed_loss(&ep, false, &Checkpointer::default())?;
        assert!(
            want.track_op(),
            "summed_loss keeps its graph for a gradient"
        );
        let (loss, correct) = m.evaluate(&ep)?;
        assert_eq!(loss, want.to_scalar::<f32>()?, "{kind:?} {method:?}");
        assert_eq!(correct, right);
        assert_eq!(stats.sum_all()?.to_scalar::<f32>()?, before);
    }
    Ok(())
}
