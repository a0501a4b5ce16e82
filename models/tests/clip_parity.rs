//! CLIP text encoders against transformers (fixtures from scripts/clip_parity.py): every hidden
//! state, the final-normed output, the pooled (projected) feature and every parameter gradient.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use ft_memory::weights::{ParamBuilder, ParamStore, SafetensorsFiles};
use ft_models::clip::{ClipTextConfig, ClipTextModel};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/clip_tiny")
        .join(name)
}

fn rel(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok(d / b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-8))
}

fn check(name: &str, with_projection: bool) -> anyhow::Result<()> {
    let dir = fixture(name);
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
        let e = rel(h, &get(&format!("hidden_states.{i}"))?)?;
        assert!(e < 1e-4, "{name}: hidden state {i} differs by {e}");
    }
    assert!(
        rel(&out.last_hidden_state, &get("last_hidden_state")?)? < 1e-4,
        "{name}: last hidden state"
    );
    let e = rel(&out.pooled, &get("pooled")?)?;
    assert!(e < 1e-4, "{name}: pooled output differs by {e}");

    let penultimate = &out.hidden_states[out.hidden_states.len() - 2];
    let loss = ((&out.pooled * get("w1")?)?.sum_all()? + (penultimate * get("w2")?)?.sum_all()?)?;
    let grads = loss.backward()?;
    let want = SafetensorsFiles::open(&[dir.join("grads.safetensors")])?;
    let m = |t: &Tensor| {
        t.abs()
            .and_then(|a| a.max_all())
            .and_then(|a| a.to_scalar::<f32>())
    };
    let mut global = 0f32;
    for n in want.names() {
        global = global.max(m(&want.load(n, None, DType::F32, &dev, false)?)?);
    }
    let mut n = 0;
    for (pname, v) in store.trainable()? {
        let Some(w) = want
            .meta(&pname)
            .map(|_| want.load(&pname, None, DType::F32, &dev, false))
            .transpose()?
        else {
            continue; // no reference gradient: checked by the count below
        };
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("{name}: `{pname}` has no gradient"));
        n += 1;
        if m(&w)? < 1e-5 * global {
            // Zero in exact arithmetic: a key bias adds the same score to every key of a query,
            // which softmax ignores. Both sides hold rounding noise.
            assert!(
                m(g)? < 1e-4 * global,
                "{name}: `{pname}` should be ~0, is {}",
                m(g)?
            );
            continue;
        }
        let e = rel(g, &w)?;
        assert!(e < 1e-4, "{name}: gradient of `{pname}` differs by {e}");
    }
    assert_eq!(
        n,
        want.names().count(),
        "{name}: every reference gradient is compared"
    );
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
