//! The bundled demo: a tiny SDXL-shaped pipeline (two-level UNet with text_time conditioning,
//! three-level VAE, two small CLIP text encoders with CLIP-style BPE tokenizers, SDXL's scheduler)
//! written as a diffusers folder, and a synthetic captioned image set (coloured shapes on plain
//! backgrounds) in diffusers' imagefolder layout. The UNet and the text encoders get seeded random
//! weights; the VAE is one fitted to such images ([`vae_fit`]), so the samples show shapes. Everything is
//! generated, so `sdxl-ft --demo` needs no download, and it goes through the same loader, cache
//! and trainer as a real model.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device};

mod images;
mod tokenizer;
pub mod vae_fit;

use ft_models::clip::{ClipTextConfig, ClipTextModel};
use ft_models::unet::{UNet, UNetConfig};
use ft_params::{ParamBuilder, ParamStore};
pub use images::{random_batch, write_images};
use images::{BACKGROUNDS, COLORS, SHAPES};
use serde_json::json;
use tokenizer::write_tokenizer;

/// Paths of a written demo.
pub struct Demo {
    pub model: PathBuf,
    pub data: PathBuf,
    /// Images the demo does not train on, one of each caption: the MMD's real set.
    pub held_out: PathBuf,
}

pub(crate) fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(v)?)
        .with_context(|| path.display().to_string())
}

/// Saves every tensor of `store` as `path`.
fn save_store(store: &Arc<ParamStore>, path: &Path) -> Result<()> {
    ft_params::fs::save_safetensors(&store.all(), path)?;
    Ok(())
}

fn vocab_words() -> Vec<&'static str> {
    let mut words = vec!["a", "on", "background"];
    words.extend(COLORS.iter().map(|c| c.0));
    words.extend(SHAPES);
    words.extend(BACKGROUNDS.iter().map(|b| b.0));
    words
}

/// The demo's VAE (`vae_fit`'s result, written by the `fit_demo_vae` example): its config and
/// weights.
const DEMO_VAE: [(&str, &[u8]); 2] = [
    (
        "config.json",
        include_bytes!("../../assets/demo-vae/config.json"),
    ),
    (
        "diffusion_pytorch_model.safetensors",
        include_bytes!("../../assets/demo-vae/diffusion_pytorch_model.safetensors"),
    ),
];

/// Writes the demo's fitted VAE as `dir` (a diffusers `vae/` folder), where it differs: a demo
/// folder from before the VAE was fitted gets it too.
fn write_vae(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    for (name, bytes) in DEMO_VAE {
        let path = dir.join(name);
        if std::fs::read(&path).ok().as_deref() != Some(bytes) {
            std::fs::write(&path, bytes).with_context(|| path.display().to_string())?;
        }
    }
    Ok(())
}

/// Writes the tiny pipeline into `dir`: UNet and text encoders with weights from `seed`, the
/// fitted VAE.
pub fn write_model(dir: &Path, seed: u64) -> Result<()> {
    let dev = Device::Cpu;
    let words = vocab_words();
    write_tokenizer(&dir.join("tokenizer"), &words, "<|endoftext|>")?;
    write_tokenizer(&dir.join("tokenizer_2"), &words, "!")?;
    let vocab_size = 256 * 2
        + words
            .iter()
            .map(|w| w.len().saturating_sub(1))
            .sum::<usize>()
        + 2;
    write_json(
        &dir.join("model_index.json"),
        &json!({
            "_class_name": "StableDiffusionXLPipeline", "_diffusers_version": "0.35.2",
            "force_zeros_for_empty_prompt": true,
            "scheduler": ["diffusers", "EulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        }),
    )?;
    write_json(
        &dir.join("scheduler/scheduler_config.json"),
        &json!({
            "_class_name": "EulerDiscreteScheduler", "beta_end": 0.012,
            "beta_schedule": "scaled_linear", "beta_start": 0.00085,
            "interpolation_type": "linear", "num_train_timesteps": 1000,
            "prediction_type": "epsilon", "steps_offset": 1, "timestep_spacing": "leading",
        }),
    )?;
    for (i, (name, proj)) in [("text_encoder", false), ("text_encoder_2", true)]
        .into_iter()
        .enumerate()
    {
        let cfg = json!({
            "architectures": [if proj { "CLIPTextModelWithProjection" } else { "CLIPTextModel" }],
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 77, "vocab_size": vocab_size,
            "projection_dim": 32, "hidden_act": if proj { "gelu" } else { "quick_gelu" },
            "layer_norm_eps": 1e-5, "bos_token_id": vocab_size - 2, "eos_token_id": 2,
            "pad_token_id": 1, "model_type": "clip_text_model",
        });
        let path = dir.join(name).join("config.json");
        write_json(&path, &cfg)?;
        let store = ParamStore::new();
        let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, seed ^ (i as u64 + 1));
        ClipTextModel::new(&pb, &ClipTextConfig::from_file(&path)?, proj)?;
        save_store(&store, &dir.join(name).join("model.safetensors"))?;
    }
    write_vae(&dir.join("vae"))?;
    let unet_cfg = json!({
        "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.35.2",
        "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
        "addition_time_embed_dim": 8, "attention_head_dim": [2, 4],
        "block_out_channels": [32, 64], "center_input_sample": false, "cross_attention_dim": 64,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "downsample_padding": 1,
        "flip_sin_to_cos": true, "freq_shift": 0, "in_channels": 4, "layers_per_block": 1,
        "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_eps": 1e-5, "norm_num_groups": 8,
        "out_channels": 4, "projection_class_embeddings_input_dim": 80, "sample_size": 8,
        "transformer_layers_per_block": [1, 1], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "upcast_attention": false, "use_linear_projection": true,
    });
    let path = dir.join("unet/config.json");
    write_json(&path, &unet_cfg)?;
    let store = ParamStore::new();
    UNet::new(
        &ParamBuilder::new(store.clone(), DType::F32, &dev, seed ^ 4),
        &UNetConfig::from_file(&path)?,
    )?;
    save_store(
        &store,
        &dir.join("unet/diffusion_pytorch_model.safetensors"),
    )?;
    Ok(())
}

/// Held-out images: one of each of the captions' colour, shape and background combinations.
pub const HELD_OUT: usize = COLORS.len() * SHAPES.len() * BACKGROUNDS.len();

/// Where [`write`] puts the demo pipeline and images under `dir`.
pub fn at(dir: &Path) -> Demo {
    Demo {
        model: dir.join("model"),
        data: dir.join("images"),
        held_out: dir.join("held-out"),
    }
}

/// Writes the demo pipeline, training images and held-out images under `dir` (once: an existing demo is reused).
pub fn write(dir: &Path, images: usize, seed: u64) -> Result<Demo> {
    let demo = at(dir);
    if !demo
        .model
        .join("unet/diffusion_pytorch_model.safetensors")
        .is_file()
    {
        write_model(&demo.model, seed)?;
    } else {
        write_vae(&demo.model.join("vae"))?;
    }
    if !demo.data.join("metadata.jsonl").is_file() {
        write_images(&demo.data, images, seed)?;
    }
    if !demo.held_out.join("metadata.jsonl").is_file() {
        write_images(&demo.held_out, HELD_OUT, seed ^ 0x4E1D)?;
    }
    Ok(demo)
}
