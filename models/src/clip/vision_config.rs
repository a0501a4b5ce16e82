//! `config.json` of a CLIP vision tower: a CLIPVisionConfig, or a whole CLIPConfig (the hub's
//! `openai/clip-vit-*` folders) whose `vision_config` and top-level `projection_dim` it takes.
//! Also the image normalisation of `preprocessor_config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

fn d_hidden() -> usize {
    768
}
fn d_inter() -> usize {
    3072
}
fn d_proj() -> usize {
    512
}
fn d_layers() -> usize {
    12
}
fn d_heads() -> usize {
    12
}
fn d_channels() -> usize {
    3
}
fn d_image() -> usize {
    224
}
fn d_patch() -> usize {
    32
}
fn d_act() -> String {
    "quick_gelu".into()
}
fn d_eps() -> f64 {
    1e-5
}

/// transformers' CLIPVisionConfig fields and defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClipVisionConfig {
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    #[serde(default = "d_proj")]
    pub projection_dim: usize,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_channels")]
    pub num_channels: usize,
    #[serde(default = "d_image")]
    pub image_size: usize,
    #[serde(default = "d_patch")]
    pub patch_size: usize,
    #[serde(default = "d_act")]
    pub hidden_act: String,
    #[serde(default = "d_eps")]
    pub layer_norm_eps: f64,
}

/// A CLIPConfig's fields this reads.
#[derive(Deserialize)]
struct Whole {
    vision_config: ClipVisionConfig,
    projection_dim: Option<usize>,
}

impl ClipVisionConfig {
    /// Reads a vision config, or the vision half of a whole CLIP model's config.
    pub fn from_file(path: &Path) -> Result<Self> {
        let value: serde_json::Value = crate::error::read_config(path)?;
        let bad = |reason: String| ModelError::Config {
            path: path.display().to_string(),
            reason,
        };
        let cfg = if value.get("vision_config").is_some() {
            let whole: Whole = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
            let mut cfg = whole.vision_config;
            // CLIPModel's visual_projection maps to the shared embedding size.
            if let Some(p) = whole.projection_dim {
                cfg.projection_dim = p;
            }
            cfg
        } else {
            serde_json::from_value(value).map_err(|e| bad(e.to_string()))?
        };
        cfg.validate().map_err(bad)?;
        Ok(cfg)
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.patch_size == 0 || !self.image_size.is_multiple_of(self.patch_size) {
            return Err(format!(
                "image_size {} must be a multiple of patch_size {}",
                self.image_size, self.patch_size
            ));
        }
        if self.hidden_size == 0
            || self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(format!(
                "hidden_size {} must be a positive multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        super::encoder::Act::parse(&self.hidden_act)?;
        Ok(())
    }

    /// Patches per side of the image.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }
}

/// Per-channel mean and standard deviation the tower's inputs are normalised with (pixels in
/// [0, 1]): `image_mean` and `image_std` of `preprocessor_config.json`, else OpenAI CLIP's.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ClipImageNorm {
    #[serde(default = "d_mean", rename = "image_mean")]
    pub mean: [f64; 3],
    #[serde(default = "d_std", rename = "image_std")]
    pub std: [f64; 3],
}

fn d_mean() -> [f64; 3] {
    [0.48145466, 0.4578275, 0.40821073]
}
fn d_std() -> [f64; 3] {
    [0.26862954, 0.26130258, 0.27577711]
}

impl Default for ClipImageNorm {
    fn default() -> Self {
        ClipImageNorm {
            mean: d_mean(),
            std: d_std(),
        }
    }
}

impl ClipImageNorm {
    /// The normalisation of `path` (a preprocessor_config.json).
    pub fn from_file(path: &Path) -> Result<Self> {
        let n: ClipImageNorm = crate::error::read_config(path)?;
        if n.std.iter().any(|s| s.is_nan() || *s <= 0.0) {
            return Err(ModelError::Config {
                path: path.display().to_string(),
                reason: format!("image_std {:?} must be positive", n.std),
            });
        }
        Ok(n)
    }
}
