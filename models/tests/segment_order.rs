//! Each model lists its checkpoint segments (`segments()`) in the order its forward runs them,
//! the order of its activation formulas' segments (`tests/activations.rs` checks those by run
//! index). The memory plan pairs the two lists by index: each segment's own gradients and
//! optimizer step sit at that segment's place in its backward walk, so a list in another order
//! would put them beside the wrong activations. Checked with the fused backward's early step,
//! which receives each segment's own parameters as that segment's backward ends (the last
//! segment first).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor, TensorId, Var};
use ft_models::dropout::DropoutCtx;
use ft_models::fewshot::{Backbone, BackboneKind, Episode, FewShotModel, Method};
use ft_models::t5::{T5Batch, T5Config, T5};
use ft_models::unet::{UNet, UNetConfig};
use ft_params::checkpoint::{Checkpointer, EarlyStep, Strategy};
use ft_params::{ParamBuilder, ParamStore};

/// The own parameters (in one segment only) of each segment as the backward hands them to the
/// early step, put back in forward order, against those of `listed` in its order.
fn check(
    label: &str,
    listed: &[Vec<Tensor>],
    params: &[Var],
    forward: &dyn Fn(&Checkpointer) -> anyhow::Result<Tensor>,
) -> anyhow::Result<()> {
    let seen: Arc<Mutex<Vec<HashSet<TensorId>>>> = Arc::default();
    let hook: EarlyStep = {
        let seen = seen.clone();
        Arc::new(move |grads: Vec<(Var, Tensor)>| {
            let ids = grads.iter().map(|(v, _)| v.id()).collect();
            seen.lock()
                .map_err(|_| candle_core::Error::Msg("poisoned".into()))?
                .push(ids);
            Ok(Vec::new())
        })
    };
    let ck = Checkpointer::with_strategy(Strategy::Blocks);
    let loss = forward(&ck)?;
    ck.gradients_with(&loss, params, Some(hook))?;
    let mut ran = seen
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    ran.reverse();
    let mut uses: HashMap<TensorId, usize> = HashMap::new();
    for id in listed
        .iter()
        .flat_map(|s| s.iter().map(|t| t.id()).collect::<HashSet<_>>())
    {
        *uses.entry(id).or_default() += 1;
    }
    let expected: Vec<HashSet<TensorId>> = listed
        .iter()
        .map(|s| {
            s.iter()
                .map(|t| t.id())
                .filter(|id| uses[id] == 1)
                .collect()
        })
        .filter(|s: &HashSet<TensorId>| !s.is_empty())
        .collect();
    assert!(
        expected.len() > 2,
        "{label}: too few segments to tell orders apart"
    );
    assert_eq!(
        ran.len(),
        expected.len(),
        "{label}: segments run against listed"
    );
    for (i, (r, e)) in ran.iter().zip(&expected).enumerate() {
        assert_eq!(
            r, e,
            "{label}: segment {i} of the forward is not segment {i} listed"
        );
    }
    Ok(())
}

fn trainable(store: &ParamStore) -> anyhow::Result<Vec<Var>> {
    Ok(store.trainable()?.into_iter().map(|(_, v)| v).collect())
}

#[test]
fn the_unet_lists_its_segments_in_forward_order() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/unet_tiny/config.json");
    let cfg = UNetConfig::from_file(&path)?;
    let store = ParamStore::new();
    let unet = UNet::new(&ParamBuilder::new(store.clone(), DType::F32, &dev, 1), &cfg)?;
    let x = Tensor::randn(0f32, 1., (1, 4, 16, 16), &dev)?;
    let ctx = Tensor::randn(0f32, 1., (1, 5, 24), &dev)?;
    let te = Tensor::randn(0f32, 1., (1, 12), &dev)?;
    let ids = Tensor::ones((1, 6), DType::F32, &dev)?;
    check("unet", &unet.segments(), &trainable(&store)?, &|ck| {
        let y = unet.forward(&x, &[10.0], &ctx, Some((&te, &ids)), ck)?;
        Ok(y.sqr()?.sum_all()?)
    })
}

#[test]
fn t5_lists_its_segments_in_forward_order() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let cfg = T5Config::tiny(64);
    let store = ParamStore::new();
    let m = T5::new(&ParamBuilder::new(store.clone(), DType::F32, &dev, 2), &cfg)?;
    let batch = T5Batch {
        input_ids: Tensor::from_vec((0..16u32).map(|i| 2 + i % 50).collect(), (2, 8), &dev)?,
        attention_mask: Tensor::ones((2, 8), DType::F32, &dev)?,
        labels: Tensor::from_vec((0..8i64).map(|i| 2 + i % 7).collect(), (2, 4), &dev)?,
        label_tokens: 8,
    };
    let drop = DropoutCtx::eval();
    check("t5", &m.segments(), &trainable(&store)?, &|ck| {
        Ok(m.summed_loss(&batch, &drop, ck)?)
    })
}

#[test]
fn the_fewshot_backbones_list_their_segments_in_forward_order() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for kind in [BackboneKind::Conv4, BackboneKind::ResNet10] {
        let store = ParamStore::new();
        let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 3);
        let bb = Backbone::new(&pb, kind, 28, true)?;
        let m = FewShotModel::new(&pb, bb, Method::FsctCosine, 3, 1)?;
        let ep = Episode {
            images: Tensor::randn(0f32, 1., (3 * 3, 3, 28, 28), &dev)?,
            n_way: 3,
            k_shot: 1,
            n_query: 2,
        };
        check(
            &format!("{kind:?}"),
            &m.segments(),
            &trainable(&store)?,
            &|ck| Ok(m.summed_loss(&ep, true, ck)?.0),
        )?;
    }
    Ok(())
}
