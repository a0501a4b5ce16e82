//! CLIP text encoders against transformers (fixtures from scripts/clip_parity.py): every hidden
//! state, the final-normed output, the pooled (projected) feature and every parameter gradient.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use ft_models::clip::{ClipTextConfig, ClipTextModel};
use ft_params::weights::SafetensorsFiles;
use ft_params::{ParamBuilder, ParamStore};

fn check(name: &str, with_projection: bool) -> anyhow::Result<()> {
    let dir = common::fixture(&format!("clip_tiny/{name}"));
    let dev = Device::Cpu;
    let cfg = ClipTextConfig::from_file(&dir.join("config.json"))?;
    let store = ParamStore::new();
    let files = Arc::new(SafetensorsFiles::open(&[dir.join("model.safetensors")])?);
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 0).with_source(files);
    let model = ClipTextModel::new(&pb, &cfg, with_projection)?;
    let outputs = candle_core::safetensors::load(dir.join("outputs.safetensors"), &dev)?;
    let get = |k: &str| {
        outputs
            .get(k)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("fixture lacks {k}"))
    };
    let ids = get("input_ids")?.to_dtype(DType::U32)?;
    let out = model.forward(&ids)?;
    assert_eq!(out.hidden_states.len(), cfg.num_hidden_layers + 1);
    for (i, h) in out.hidden_states.iter().enumerate() {
        let e = common::rel(h, &get(&format!("hidden_states.{i}"))?)?;
        assert!(e < 1e-4, "{name}: hidden state {i} differs by {e}");
    }
    assert!(
        common::rel(&out.last_hidden_state, &get("last_hidden_state")?)? < 1e-4,
        "{name}: last hidden state"
    );
    let e = common::rel(&out.pooled, &get("pooled")?)?;
    assert!(e < 1e-4, "{name}: pooled output differs by {e}");

    let penultimate = &out.hidden_states[out.hidden_states.len() - 2];
    let loss = ((&out.pooled * get("w1")?)?.sum_all()? + (penultimate * get("w2")?)?.sum_all()?)?;
    let grads = loss.backward()?;
    let ours: Vec<(String, Option<Tensor>)> = store
        .trainable()?
        .into_iter()
        .map(|(n, v)| (n, grads.get(v.as_tensor()).cloned()))
        .collect();
    common::compare_gradients(&dir.join("grads.safetensors"), &ours, 1e-4, name)?;
    Ok(())
}

#[test]
fn clip_vit_l_text_encoder_matches_transformers() -> anyhow::Result<()> {
    check("clip_l", false)
}

#[test]
fn openclip_bigg_style_encoder_with_projection_matches_transformers() -> anyhow::Result<()> {
    check("clip_g", true)
}
