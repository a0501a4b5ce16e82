//! Where a model's files come from: a sharded checkpoint in a folder (and in a diffusers
//! subfolder) through its index; a hub id from an hf-hub cache folder with HF_HUB_OFFLINE=1 (no
//! network), where a file the cache lacks is a clear error. Its own test binary, because it sets
//! process env vars.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use ft_trainer::train::ModelRepo;

mod common;
use common::{build, shapes_of, tensors, tmpdir, write};

#[test]
fn hub_id_loads_from_cache_offline() -> anyhow::Result<()> {
    let home = std::env::temp_dir().join(format!("ft-hf-home-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let repo_dir = home.join("hub").join("models--tiny-org--tiny-t5");
    let snap = repo_dir.join("snapshots").join(commit);
    std::fs::create_dir_all(&snap)?;
    std::fs::create_dir_all(repo_dir.join("refs"))?;
    std::fs::write(repo_dir.join("refs").join("main"), commit)?;
    let w = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((3, 4))?;
    ft_params::fs::save_safetensors(
        &[("shared.weight".into(), w.clone())],
        &snap.join("model.safetensors"),
    )?;
    std::fs::write(snap.join("config.json"), "{}")?;

    std::env::set_var("HF_HOME", &home);
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let repo = ModelRepo::open("tiny-org/tiny-t5")?;
    assert!(matches!(repo, ModelRepo::Hub { .. }));
    assert!(repo.get("config.json")?.starts_with(&home));
    let files = repo.safetensors("model")?;
    let got = files.load(
        "shared.weight",
        Some(&[3, 4]),
        DType::BF16,
        &Device::Cpu,
        true,
    )?;
    assert_eq!(got.dtype(), DType::BF16);
    assert_eq!(
        got.to_dtype(DType::F32)?.to_vec2::<f32>()?,
        w.to_vec2::<f32>()?
    );

    let e = repo.get("tokenizer.json").unwrap_err().to_string();
    assert!(
        e.contains("tiny-org/tiny-t5")
            && e.contains("tokenizer.json")
            && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
    // Offline, a file absent from the cache cannot be told absent from the repository: an
    // optional lookup is an error too, never a silent "no such file".
    let e = repo
        .find("model.safetensors.index.json")
        .unwrap_err()
        .to_string();
    assert!(e.contains("HF_HUB_OFFLINE"), "{e}");
    let e = ModelRepo::open("not a model id").unwrap_err().to_string();
    assert!(e.contains("not a model id"), "{e}");
    std::fs::remove_dir_all(&home)?;
    Ok(())
}

#[test]
fn sharded_checkpoint_loads_through_its_index() -> anyhow::Result<()> {
    let dir = tmpdir("sharded");
    let ts = tensors(DType::F32)?;
    let (a, b) = ts.split_at(2);
    write(&dir.join("model-00001-of-00002.safetensors"), a)?;
    write(&dir.join("model-00002-of-00002.safetensors"), b)?;
    let mut map = serde_json::Map::new();
    for (i, (n, _)) in ts.iter().enumerate() {
        let f = if i < 2 {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        map.insert(n.clone(), serde_json::Value::from(f));
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string())?;
    // The same shards in a diffusers subfolder (`unet/`): shard names are relative to it.
    let sub = dir.join("unet");
    std::fs::create_dir_all(&sub)?;
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ] {
        std::fs::copy(dir.join(f), sub.join(f))?;
    }
    let repo = ModelRepo::open(dir.to_str().unwrap_or_default())?;
    assert!(
        repo.find("model.safetensors")?.is_none(),
        "absent from the folder"
    );
    assert!(repo.find("model.safetensors.index.json")?.is_some());
    for stem in ["model", "unet/model"] {
        let files = Arc::new(repo.safetensors(stem)?);
        assert_eq!(files.paths().len(), 2);
        let store = build(files, DType::F32, &shapes_of(&ts))?;
        for (name, t) in &ts {
            let got = store.get(name).expect("loaded");
            let d = (got - t)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "{stem}: {name}");
        }
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
