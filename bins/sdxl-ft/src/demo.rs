//! The bundled demo: a tiny SDXL-shaped pipeline (two-level UNet with text_time conditioning,
//! three-level VAE, two small CLIP text encoders with CLIP-style BPE tokenizers, SDXL's scheduler)
//! written as a diffusers folder with seeded random weights, and a synthetic captioned image set
//! (coloured shapes on plain backgrounds) in diffusers' imagefolder layout. Everything is
//! generated, so `sdxl-ft --demo` needs no download, and it goes through the same loader, cache
//! and trainer as a real model.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use ft_models::clip::{ClipTextConfig, ClipTextModel};
use ft_models::unet::{UNet, UNetConfig};
use ft_models::vae::{Vae, VaeConfig};
use ft_params::rng::SplitMix64;
use ft_params::{ParamBuilder, ParamStore};
use serde_json::json;

const COLORS: [(&str, [u8; 3]); 4] = [
    ("red", [220, 40, 40]),
    ("green", [40, 180, 60]),
    ("blue", [40, 70, 220]),
    ("yellow", [230, 210, 40]),
];
const SHAPES: [&str; 3] = ["circle", "square", "triangle"];
const BACKGROUNDS: [(&str, [u8; 3]); 2] = [("white", [245, 245, 245]), ("black", [15, 15, 15])];

/// Paths of a written demo.
pub struct Demo {
    pub model: PathBuf,
    pub data: PathBuf,
}

/// GPT-2's byte-to-character table that CLIP's BPE vocabulary is written in.
fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap_or(' ');
    }
    table
}

/// A CLIP-layout tokenizer (vocab.json, merges.txt, special tokens) whose merges spell `words`.
fn write_tokenizer(dir: &Path, words: &[&str], pad: &str) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut vocab = serde_json::Map::new();
    let add = |t: String, vocab: &mut serde_json::Map<String, serde_json::Value>| {
        if !vocab.contains_key(&t) {
            let id = vocab.len();
            vocab.insert(t, json!(id));
        }
    };
    let chars = bytes_to_unicode();
    for c in &chars {
        add(c.to_string(), &mut vocab);
    }
    for c in &chars {
        add(format!("{c}</w>"), &mut vocab);
    }
    let mut merges: Vec<String> = Vec::new();
    for w in words {
        let mut symbols: Vec<String> = w.chars().map(|c| c.to_string()).collect();
        if let Some(last) = symbols.last_mut() {
            last.push_str("</w>");
        }
        let mut cur = symbols[0].clone();
        for s in &symbols[1..] {
            let pair = format!("{cur} {s}");
            if !merges.contains(&pair) {
                merges.push(pair);
            }
            cur.push_str(s);
            add(cur.clone(), &mut vocab);
        }
    }
    add("<|startoftext|>".into(), &mut vocab);
    add("<|endoftext|>".into(), &mut vocab);
    std::fs::write(
        dir.join("vocab.json"),
        serde_json::Value::Object(vocab).to_string(),
    )?;
    std::fs::write(
        dir.join("merges.txt"),
        format!("#version: 0.2\n{}\n", merges.join("\n")),
    )?;
    std::fs::write(
        dir.join("special_tokens_map.json"),
        json!({"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
               "pad_token": pad, "unk_token": "<|endoftext|>"})
        .to_string(),
    )?;
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"model_max_length": 77, "tokenizer_class": "CLIPTokenizer"}).to_string(),
    )?;
    Ok(())
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
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

/// Writes the tiny pipeline into `dir`.
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
    let vae_cfg = json!({
        "_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"], "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"],
        "block_out_channels": [16, 32, 32], "layers_per_block": 1, "latent_channels": 4,
        "norm_num_groups": 8, "sample_size": 32, "scaling_factor": 0.13025,
    });
    let path = dir.join("vae/config.json");
    write_json(&path, &vae_cfg)?;
    let store = ParamStore::new();
    Vae::new(
        &ParamBuilder::new(store.clone(), DType::F32, &dev, seed ^ 3),
        &VaeConfig::from_file(&path)?,
    )?;
    save_store(&store, &dir.join("vae/diffusion_pytorch_model.safetensors"))?;
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

/// Writes `n` captioned shape images (sizes vary, so resize and crop are exercised) with a
/// metadata.jsonl into `dir`.
pub fn write_images(dir: &Path, n: usize, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut rng = SplitMix64::new(seed ^ 0x1A6E);
    let mut meta = String::new();
    for i in 0..n {
        let (cname, color) = COLORS[i % COLORS.len()];
        let shape = SHAPES[(i / COLORS.len()) % SHAPES.len()];
        let (bname, bg) = BACKGROUNDS[(i / (COLORS.len() * SHAPES.len())) % BACKGROUNDS.len()];
        let (w, h) = (48 + 8 * rng.below(3), 48 + 8 * rng.below(3));
        let (cx, cy) = (w as f64 / 2.0, h as f64 / 2.0);
        let r = 12.0 + rng.uniform() * 6.0;
        let img = image::RgbImage::from_fn(w as u32, h as u32, |x, y| {
            let (dx, dy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
            let inside = match shape {
                "circle" => dx * dx + dy * dy <= r * r,
                "square" => dx.abs() <= r * 0.85 && dy.abs() <= r * 0.85,
                _ => dy >= -r && dy <= r * 0.8 && dx.abs() <= (dy + r) * 0.6,
            };
            image::Rgb(if inside { color } else { bg })
        });
        let file = format!("{i:03}.png");
        img.save(dir.join(&file))
            .with_context(|| dir.join(&file).display().to_string())?;
        meta.push_str(
            &json!({"file_name": file, "text": format!("a {cname} {shape} on a {bname} background")})
                .to_string(),
        );
        meta.push('\n');
    }
    std::fs::write(dir.join("metadata.jsonl"), meta)?;
    Ok(())
}

/// Writes the demo pipeline and images under `dir` (once: an existing demo is reused).
pub fn write(dir: &Path, images: usize, seed: u64) -> Result<Demo> {
    let demo = Demo {
        model: dir.join("model"),
        data: dir.join("images"),
    };
    if !demo
        .model
        .join("unet/diffusion_pytorch_model.safetensors")
        .is_file()
    {
        write_model(&demo.model, seed)?;
    }
    if !demo.data.join("metadata.jsonl").is_file() {
        write_images(&demo.data, images, seed)?;
    }
    Ok(demo)
}
