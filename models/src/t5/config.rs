//! `config.json` of a T5 model, with the fields and defaults of transformers' `T5Config`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

fn default_vocab() -> usize {
    32128
}
fn default_d_model() -> usize {
    512
}
fn default_d_kv() -> usize {
    64
}
fn default_d_ff() -> usize {
    2048
}
fn default_layers() -> usize {
    6
}
fn default_heads() -> usize {
    8
}
fn default_buckets() -> usize {
    32
}
fn default_max_distance() -> usize {
    128
}
fn default_dropout() -> f64 {
    0.1
}
fn default_eps() -> f64 {
    1e-6
}
fn default_ff_proj() -> String {
    "relu".into()
}
fn default_true() -> bool {
    true
}
fn default_eos() -> u32 {
    1
}

/// T5 hyper-parameters as `config.json` spells them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct T5Config {
    #[serde(default = "default_vocab")]
    pub vocab_size: usize,
    #[serde(default = "default_d_model")]
    pub d_model: usize,
    #[serde(default = "default_d_kv")]
    pub d_kv: usize,
    #[serde(default = "default_d_ff")]
    pub d_ff: usize,
    #[serde(default = "default_layers")]
    pub num_layers: usize,
    /// Defaults to `num_layers`.
    #[serde(default)]
    pub num_decoder_layers: Option<usize>,
    #[serde(default = "default_heads")]
    pub num_heads: usize,
    #[serde(default = "default_buckets")]
    pub relative_attention_num_buckets: usize,
    #[serde(default = "default_max_distance")]
    pub relative_attention_max_distance: usize,
    #[serde(default = "default_dropout")]
    pub dropout_rate: f64,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// `relu` (original T5), `gated-gelu` (v1.1 / FLAN), also `gelu`, `gated-relu`, `gated-silu`.
    #[serde(default = "default_ff_proj")]
    pub feed_forward_proj: String,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub pad_token_id: u32,
    #[serde(default = "default_eos")]
    pub eos_token_id: u32,
    /// Defaults to `pad_token_id` (as in T5).
    #[serde(default)]
    pub decoder_start_token_id: Option<u32>,
    /// Everything else in the file (architectures, model_type, task_specific_params, ...), kept so
    /// a saved config.json round-trips.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// The feed-forward activation and whether it is gated (`wi_0`/`wi_1`) or not (`wi`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfAct {
    Relu,
    /// transformers' `gelu_new` (tanh approximation), what "gated-gelu" and "gelu" mean in T5.
    GeluNew,
    Silu,
}

impl T5Config {
    /// Reads and checks `config.json`, naming the file in any error.
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg = crate::error::read_config::<T5Config>(path)?;
        cfg.validate().map_err(|reason| ModelError::Config {
            path: path.display().to_string(),
            reason,
        })?;
        Ok(cfg)
    }

    /// A tiny configuration for demos and tests (v1.1 style, gated-gelu, untied head).
    pub fn tiny(vocab_size: usize) -> Self {
        T5Config {
            vocab_size,
            d_model: 32,
            d_kv: 8,
            d_ff: 64,
            num_layers: 2,
            num_decoder_layers: Some(2),
            num_heads: 4,
            relative_attention_num_buckets: 8,
            relative_attention_max_distance: 16,
            dropout_rate: 0.0,
            layer_norm_epsilon: 1e-6,
            feed_forward_proj: "gated-gelu".into(),
            tie_word_embeddings: false,
            pad_token_id: 0,
            eos_token_id: 1,
            decoder_start_token_id: Some(0),
            extra: serde_json::Map::new(),
        }
    }

    pub fn decoder_layers(&self) -> usize {
        self.num_decoder_layers.unwrap_or(self.num_layers)
    }

    pub fn decoder_start(&self) -> u32 {
        self.decoder_start_token_id.unwrap_or(self.pad_token_id)
    }

    /// (activation, gated) from `feed_forward_proj`.
    pub fn activation(&self) -> std::result::Result<(FfAct, bool), String> {
        let s = self.feed_forward_proj.as_str();
        let (gated, act) = match s.strip_prefix("gated-") {
            Some(a) => (true, a),
            None => (false, s),
        };
        let act = match act {
            "relu" => FfAct::Relu,
            "gelu" | "gelu_new" => FfAct::GeluNew,
            "silu" | "swish" => FfAct::Silu,
            other => {
                return Err(format!(
                    "feed_forward_proj `{other}` is not supported (relu, gelu, silu, optionally gated-)"
                ))
            }
        };
        Ok((act, gated))
    }

    /// Checks values no model can have.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.activation()?;
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("d_kv", self.d_kv),
            ("d_ff", self.d_ff),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            (
                "relative_attention_num_buckets",
                self.relative_attention_num_buckets,
            ),
        ] {
            if v == 0 {
                return Err(format!("`{name}` must be at least 1"));
            }
        }
        if !(0.0..1.0).contains(&self.dropout_rate) {
            return Err(format!(
                "`dropout_rate` {} must be in [0, 1)",
                self.dropout_rate
            ));
        }
        if self.pad_token_id as usize >= self.vocab_size
            || self.eos_token_id as usize >= self.vocab_size
        {
            return Err("pad/eos token ids must be below vocab_size".into());
        }
        Ok(())
    }
}

impl T5Config {
    /// Shapes of every parameter the model creates, without allocating them (for memory plans of
    /// models too large to build here, such as FLAN-T5-XL).
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (d, inner, ff) = (self.d_model, self.num_heads * self.d_kv, self.d_ff);
        let gated = self.activation().map(|(_, g)| g).unwrap_or(false);
        let mut v = vec![("shared.weight".to_string(), vec![self.vocab_size, d])];
        for (stack, n, decoder) in [
            ("encoder", self.num_layers, false),
            ("decoder", self.decoder_layers(), true),
        ] {
            v.push((
                format!("{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
                vec![self.relative_attention_num_buckets, self.num_heads],
            ));
            for i in 0..n {
                let b = format!("{stack}.block.{i}");
                let mut attn = |layer: &str, name: &str| {
                    for p in ["q", "k", "v"] {
                        v.push((format!("{b}.{layer}.{name}.{p}.weight"), vec![inner, d]));
                    }
                    v.push((format!("{b}.{layer}.{name}.o.weight"), vec![d, inner]));
                    v.push((format!("{b}.{layer}.layer_norm.weight"), vec![d]));
                };
                attn("layer.0", "SelfAttention");
                let ff_layer = if decoder {
                    attn("layer.1", "EncDecAttention");
                    "layer.2"
                } else {
                    "layer.1"
                };
                let wis: &[&str] = if gated { &["wi_0", "wi_1"] } else { &["wi"] };
                for w in wis {
                    v.push((
                        format!("{b}.{ff_layer}.DenseReluDense.{w}.weight"),
                        vec![ff, d],
                    ));
                }
                v.push((
                    format!("{b}.{ff_layer}.DenseReluDense.wo.weight"),
                    vec![d, ff],
                ));
                v.push((format!("{b}.{ff_layer}.layer_norm.weight"), vec![d]));
            }
            v.push((format!("{stack}.final_layer_norm.weight"), vec![d]));
        }
        if !self.tie_word_embeddings {
            v.push(("lm_head.weight".to_string(), vec![self.vocab_size, d]));
        }
        v
    }

    /// Number of parameters.
    pub fn param_count(&self) -> usize {
        self.param_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }
}
