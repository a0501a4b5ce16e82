//! CLIP text encoders against transformers (fixtures from scripts/clip_parity.py): every hidden
//! state, the final-normed output, the pooled (projected) feature and every parameter gradient;
//! the vision tower likewise, and the preprocessing that feeds it decoded samples.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use ft_models::clip::{
    ClipImageNorm, ClipTextConfig, ClipTextModel, ClipVisionConfig, ClipVisionModel,
};
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
    let outputs = common::Fixture::load(&dir.join("outputs.safetensors"))?;
    let get = |k: &str| outputs.get(k);
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
    let ours = common::store_gradients(&store, &grads)?;
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

#[test]
fn clip_vision_tower_and_its_preprocessing_match_transformers_and_torch() -> anyhow::Result<()> {
    let dir = common::fixture("clip_tiny/vision");
    let dev = Device::Cpu;
    let cfg = ClipVisionConfig::from_file(&dir.join("config.json"))?;
    let store = ParamStore::new();
    let files = Arc::new(SafetensorsFiles::open(&[dir.join("model.safetensors")])?);
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 0).with_source(files);
    let model = ClipVisionModel::new(&pb, &cfg)?;
    let outputs = common::Fixture::load(&dir.join("outputs.safetensors"))?;
    let get = |k: &str| outputs.get(k);
    // A wider-than-tall pair shrunk (antialiased) and a small image enlarged, as torch does.
    let norm = ClipImageNorm::default();
    let pixels = Tensor::cat(
        &[
            model.preprocess(&get("wide")?, &norm)?,
            model.preprocess(&get("small")?, &norm)?,
        ],
        0,
    )?;
    let e = common::rel(&pixels, &get("pixel_values")?)?;
    assert!(e < 1e-5, "preprocessed pixels differ by {e}");

    let out = model.forward(&get("pixel_values")?)?;
    let e = common::rel(&out.last_hidden_state, &get("last_hidden_state")?)?;
    assert!(e < 1e-4, "last hidden state differs by {e}");
    let e = common::rel(&out.image_embeds, &get("image_embeds")?)?;
    assert!(e < 1e-4, "image embeddings differ by {e}");

    let loss = ((&out.image_embeds * get("w1")?)?.sum_all()?
        + (&out.last_hidden_state * get("w2")?)?.sum_all()?)?;
    let grads = loss.backward()?;
    let ours = common::store_gradients(&store, &grads)?;
    common::compare_gradients(&dir.join("grads.safetensors"), &ours, 1e-4, "vision")?;
    Ok(())
}

#[test]
fn a_whole_clip_config_gives_its_vision_half_and_shared_projection() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("clip-vision-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("config.json");
    std::fs::write(
        &path,
        r#"{"model_type": "clip", "projection_dim": 768,
            "text_config": {"hidden_size": 768},
            "vision_config": {"hidden_size": 1024, "patch_size": 14, "num_hidden_layers": 24,
                              "num_attention_heads": 16, "intermediate_size": 4096}}"#,
    )?;
    let cfg = ClipVisionConfig::from_file(&path)?;
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.projection_dim,
            cfg.grid(),
            cfg.image_size
        ),
        (1024, 768, 16, 224)
    );
    std::fs::write(&path, r#"{"image_size": 30, "patch_size": 14}"#)?;
    let err = ClipVisionConfig::from_file(&path).unwrap_err().to_string();
    assert!(
        err.contains("config.json") && err.contains("multiple of patch_size 14"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
