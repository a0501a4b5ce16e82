//! `config.json` of a CLIP text encoder (transformers' CLIPTextConfig fields and defaults).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

fn d_vocab() -> usize {
    49408
}
fn d_hidden() -> usize {
    512
}
fn d_inter() -> usize {
    2048
}
fn d_proj() -> usize {
    512
}
fn d_layers() -> usize {
    12
}
fn d_heads() -> usize {
    8
}
fn d_pos() -> usize {
    77
}
fn d_act() -> String {
    "quick_gelu".into()
}
fn d_eps() -> f64 {
    1e-5
}
fn d_eos() -> u32 {
    2
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClipTextConfig {
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
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
    #[serde(default = "d_pos")]
    pub max_position_embeddings: usize,
    /// `quick_gelu` (CLIP ViT-L), `gelu` (OpenCLIP bigG).
    #[serde(default = "d_act")]
    pub hidden_act: String,
    #[serde(default = "d_eps")]
    pub layer_norm_eps: f64,
    /// With the legacy value 2, the pooled token is the one with the highest id (as transformers
    /// does for old configs); otherwise the first `eos_token_id`.
    #[serde(default = "d_eos")]
    pub eos_token_id: u32,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ClipTextConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg = crate::error::read_config::<ClipTextConfig>(path)?;
        cfg.validate().map_err(|reason| ModelError::Config {
            path: path.display().to_string(),
            reason,
        })?;
        Ok(cfg)
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
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
}
