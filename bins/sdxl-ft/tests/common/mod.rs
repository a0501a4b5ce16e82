//! Shared helpers of sdxl-ft's tests: fresh folders, demo arguments, reading saved weights.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use clap::Parser;
use ft_params::weights::SafetensorsFiles;
use ft_trainer::scratch::Scratch;
use sdxl_ft::cli::Args;

/// A scratch path for `name`, absent at first and removed when dropped.
pub fn tmp(name: &str) -> Scratch {
    Scratch::new(&format!("sdxl-ft-{name}"))
}

pub fn args(out: &Path, extra: &[&str]) -> anyhow::Result<Args> {
    let out = out.display().to_string();
    let mut v = vec![
        "sdxl-ft",
        "--demo",
        "--quiet",
        "--output-dir",
        &out,
        "--res",
        "32",
        "--batch-size",
        "4",
        "--lr",
        "1e-3",
        "--weight-decay",
        "0",
        "--sample-steps",
        "4",
        "--num-samples",
        "2",
        "--eval-images",
        "8",
    ];
    v.extend_from_slice(extra);
    Ok(Args::try_parse_from(v)?)
}

pub fn tensors(path: &Path) -> anyhow::Result<Vec<(String, Vec<f32>)>> {
    let files = SafetensorsFiles::open(&[path.to_path_buf()])?;
    let mut names: Vec<String> = files.names().map(str::to_string).collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let t = files.load(
                &n,
                None,
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
                false,
            )?;
            Ok((n, t.flatten_all()?.to_vec1()?))
        })
        .collect()
}

/// A tiny CLIP vision tower with seeded random weights as a folder `--eval-clip-model` loads
/// (config.json, model.safetensors; no preprocessor_config.json, so OpenAI's normalisation).
pub fn tiny_clip(dir: &Path) -> anyhow::Result<PathBuf> {
    use ft_models::clip::{ClipVisionConfig, ClipVisionModel};
    use ft_params::{ParamBuilder, ParamStore};
    std::fs::create_dir_all(dir)?;
    let cfg = serde_json::json!({
        "model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 16, "patch_size": 8,
        "projection_dim": 8, "hidden_act": "quick_gelu",
    });
    std::fs::write(dir.join("config.json"), cfg.to_string())?;
    let store = ParamStore::new();
    let pb = ParamBuilder::new(
        store.clone(),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        5,
    );
    ClipVisionModel::new(&pb, &ClipVisionConfig::from_file(&dir.join("config.json"))?)?;
    ft_params::fs::save_safetensors(&store.all(), &dir.join("model.safetensors"))?;
    Ok(dir.to_path_buf())
}
