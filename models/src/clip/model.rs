//! The CLIP text transformer: token + position embeddings, pre-LN layers with causal
//! self-attention, final layer norm, pooled end-of-text feature, optional projection.

use candle_core::{DType, IndexOp, Tensor};
use ft_kernels::{attention, linear, norm};
use ft_memory::weights::{Init, ParamBuilder};

use super::config::ClipTextConfig;
use crate::error::{ModelError, Result};

#[derive(Clone)]
struct Lin {
    w: Tensor,
    b: Option<Tensor>,
}

impl Lin {
    fn new(pb: &ParamBuilder, din: usize, dout: usize, bias: bool) -> Result<Self> {
        Ok(Lin {
            w: pb.get(&[dout, din], "weight", Init::Normal { std: 0.02 })?,
            b: if bias {
                Some(pb.get(&[dout], "bias", Init::Zeros)?)
            } else {
                None
            },
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        linear::linear(x, &self.w, self.b.as_ref())
    }
}

#[derive(Clone)]
struct Ln {
    w: Tensor,
    b: Tensor,
    eps: f64,
}

impl Ln {
    fn new(pb: &ParamBuilder, dim: usize, eps: f64) -> Result<Self> {
        Ok(Ln {
            w: pb.get(&[dim], "weight", Init::Ones)?,
            b: pb.get(&[dim], "bias", Init::Zeros)?,
            eps,
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        norm::layer_norm(x, Some(&self.w), Some(&self.b), self.eps)
    }
}

struct Layer {
    ln1: Ln,
    q: Lin,
    k: Lin,
    v: Lin,
    o: Lin,
    ln2: Ln,
    fc1: Lin,
    fc2: Lin,
}

/// Every layer's hidden state and the pooled feature.
pub struct ClipTextOutput {
    /// [embeddings, after layer 1, ..., after layer L], each [B, L, D] (no final norm), as
    /// transformers' `hidden_states`: SDXL uses `hidden_states[-2]`.
    pub hidden_states: Vec<Tensor>,
    /// Final-layer-normed last hidden state [B, L, D].
    pub last_hidden_state: Tensor,
    /// The end-of-text token's feature [B, D], projected to [B, projection_dim] when the model
    /// has a `text_projection`.
    pub pooled: Tensor,
}

/// CLIPTextModel, or CLIPTextModelWithProjection when built `with_projection`.
pub struct ClipTextModel {
    cfg: ClipTextConfig,
    token: Tensor,
    position: Tensor,
    layers: Vec<Layer>,
    final_ln: Ln,
    projection: Option<Tensor>,
}

impl ClipTextModel {
    pub fn new(pb: &ParamBuilder, cfg: &ClipTextConfig, with_projection: bool) -> Result<Self> {
        cfg.validate().map_err(ModelError::Invalid)?;
        let d = cfg.hidden_size;
        let t = pb.pp("text_model");
        let e = t.pp("embeddings");
        let token = e.pp("token_embedding").get(
            &[cfg.vocab_size, d],
            "weight",
            Init::Normal { std: 0.02 },
        )?;
        let position = e.pp("position_embedding").get(
            &[cfg.max_position_embeddings, d],
            "weight",
            Init::Normal { std: 0.01 },
        )?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = t.pp(format!("encoder.layers.{i}"));
            let a = l.pp("self_attn");
            layers.push(Layer {
                ln1: Ln::new(&l.pp("layer_norm1"), d, cfg.layer_norm_eps)?,
                q: Lin::new(&a.pp("q_proj"), d, d, true)?,
                k: Lin::new(&a.pp("k_proj"), d, d, true)?,
                v: Lin::new(&a.pp("v_proj"), d, d, true)?,
                o: Lin::new(&a.pp("out_proj"), d, d, true)?,
                ln2: Ln::new(&l.pp("layer_norm2"), d, cfg.layer_norm_eps)?,
                fc1: Lin::new(&l.pp("mlp.fc1"), d, cfg.intermediate_size, true)?,
                fc2: Lin::new(&l.pp("mlp.fc2"), cfg.intermediate_size, d, true)?,
            });
        }
        let final_ln = Ln::new(&t.pp("final_layer_norm"), d, cfg.layer_norm_eps)?;
        let projection = if with_projection {
            Some(pb.pp("text_projection").get(
                &[cfg.projection_dim, d],
                "weight",
                Init::Normal { std: 0.02 },
            )?)
        } else {
            None
        };
        Ok(ClipTextModel {
            cfg: cfg.clone(),
            token,
            position,
            layers,
            final_ln,
            projection,
        })
    }

    pub fn config(&self) -> &ClipTextConfig {
        &self.cfg
    }

    fn act(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.cfg.hidden_act.as_str() {
            // x * sigmoid(1.702 x) = silu(1.702 x) / 1.702
            "quick_gelu" => (x * 1.702)?.silu()? / 1.702,
            _ => x.gelu_erf(),
        }
    }

    /// Encodes token ids [B, L] (L <= max_position_embeddings) with a causal mask.
    pub fn forward(&self, ids: &Tensor) -> Result<ClipTextOutput> {
        let (b, l) = ids.dims2()?;
        if l > self.cfg.max_position_embeddings {
            return Err(ModelError::Invalid(format!(
                "{l} tokens exceed max_position_embeddings {}",
                self.cfg.max_position_embeddings
            )));
        }
        let d = self.cfg.hidden_size;
        let (h, hd) = (
            self.cfg.num_attention_heads,
            d / self.cfg.num_attention_heads,
        );
        let tok = self
            .token
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, l, d))?;
        let mut x = tok.broadcast_add(&self.position.narrow(0, 0, l)?.unsqueeze(0)?)?;
        let causal: Vec<f32> = (0..l * l)
            .map(|i| if i % l > i / l { f32::MIN } else { 0.0 })
            .collect();
        let causal = Tensor::from_vec(causal, (1, 1, l, l), x.device())?.to_dtype(x.dtype())?;
        let mut hidden_states = vec![x.clone()];
        let split = |t: Tensor| -> candle_core::Result<Tensor> {
            t.reshape((b, l, h, hd))?.transpose(1, 2)
        };
        for layer in &self.layers {
            let n = layer.ln1.forward(&x)?;
            let (q, k, v) = (
                split(layer.q.forward(&n)?)?,
                split(layer.k.forward(&n)?)?,
                split(layer.v.forward(&n)?)?,
            );
            let a = attention::sdpa(&q, &k, &v, Some(&causal), (hd as f64).powf(-0.5))?;
            let a = a.transpose(1, 2)?.reshape((b, l, d))?;
            x = (x + layer.o.forward(&a)?)?;
            let m = layer
                .fc2
                .forward(&self.act(&layer.fc1.forward(&layer.ln2.forward(&x)?)?)?)?;
            x = (x + m)?;
            hidden_states.push(x.clone());
        }
        let last = self.final_ln.forward(&x)?;
        // The pooled token: highest id for legacy configs (eos_token_id == 2), else first EOS.
        let rows = ids.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let mut pooled = Vec::with_capacity(b);
        for (i, r) in rows.iter().enumerate() {
            let pos = if self.cfg.eos_token_id == 2 {
                r.iter()
                    .enumerate()
                    .max_by_key(|(j, t)| (**t, std::cmp::Reverse(*j)))
                    .map(|(j, _)| j)
                    .unwrap_or(0)
            } else {
                r.iter()
                    .position(|&t| t == self.cfg.eos_token_id)
                    .unwrap_or(l - 1)
            };
            pooled.push(last.i((i, pos))?);
        }
        let mut pooled = Tensor::stack(&pooled, 0)?;
        if let Some(p) = &self.projection {
            pooled = linear::linear(&pooled, p, None)?;
        }
        Ok(ClipTextOutput {
            hidden_states,
            last_hidden_state: last,
            pooled,
        })
    }
}
