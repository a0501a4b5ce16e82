//! A hub id resolves from an hf-hub cache folder with HF_HUB_OFFLINE=1 (no network), and a file
//! that the cache lacks is a clear error. Its own test binary, because it sets process env vars.

use candle_core::{DType, Device, Tensor};
use ft_params::weights::ModelRepo;

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
    let e = ModelRepo::open("not a model id").unwrap_err().to_string();
    assert!(e.contains("not a model id"), "{e}");
    std::fs::remove_dir_all(&home)?;
    Ok(())
}
