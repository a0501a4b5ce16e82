//! Parity with PyTorch (fixtures from scripts/fsct_parity.py): Conv4 + FSCT (cosine and softmax)
//! on a 3-way 1-shot episode in training mode: query scores, summed cross-entropy and every
//! parameter's gradient within 1e-4 relative.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device};
use ft_models::fewshot::{Backbone, BackboneKind, Episode, FewShotModel, Method};
use ft_params::checkpoint::Checkpointer;
use ft_params::weights::SafetensorsFiles;
use ft_params::{ParamBuilder, ParamStore};

fn check(variant: &str, method: Method) -> anyhow::Result<()> {
    let dir = common::fixture(&format!("fsct_tiny/{variant}"));
    let dev = Device::Cpu;
    let weights = Arc::new(SafetensorsFiles::open(&[dir.join("model.safetensors")])?);
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 0).with_source(weights);
    let model = FewShotModel::new(
        &pb,
        Backbone::new(&pb, BackboneKind::Conv4, 16, true)?,
        method,
        3,
        1,
    )?;
    let ep_file = SafetensorsFiles::open(&[dir.join("episode.safetensors")])?;
    let load = |n: &str| ep_file.load(n, None, DType::F32, &dev, false);
    let ep = Episode {
        images: load("images")?,
        n_way: 3,
        k_shot: 1,
        n_query: 2,
    };
    let scores = model.scores(&ep, true, &Checkpointer::default())?;
    let e = common::rel(&scores, &load("scores")?)?;
    assert!(e < 1e-4, "{variant}: scores differ by {e} relative");
    let (loss, _) = model.summed_loss(&ep, true, &Checkpointer::default())?;
    let want = load("loss")?.squeeze(0)?;
    let e = common::rel(&loss, &want)?;
    assert!(e < 1e-4, "{variant}: loss differs by {e} relative");
    let grads = loss.backward()?;
    let ours = common::store_gradients(&store, &grads)?;
    common::compare_gradients(&dir.join("grads.safetensors"), &ours, 1e-4, variant)?;
    Ok(())
}

#[test]
fn fsct_cosine_matches_pytorch() -> anyhow::Result<()> {
    check("cosine", Method::FsctCosine)
}

#[test]
fn fsct_softmax_matches_pytorch() -> anyhow::Result<()> {
    check("softmax", Method::FsctSoftmax)
}
