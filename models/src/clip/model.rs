//! The CLIP text transformer: token + position embeddings, pre-LN layers with causal
//! self-attention, final layer norm, pooled end-of-text feature, optional projection.

use candle_core::{DType, IndexOp, Tensor};
use ft_kernels::{attention, linear};
use ft_params::{Init, ParamBuilder};

use super::config::ClipTextConfig;
use crate::error::{ModelError, Result};
use crate::layers::{Linear, Norm};

struct Layer {
    ln1: Norm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln2: Norm,
    fc1: Linear,
    fc2: Linear,
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
    final_ln: Norm,
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
        // CLIP's initialisation: N(0, 0.02) weights, zero biases.
        let lin = |pb: &ParamBuilder, din: usize, dout: usize| {
            Linear::with_init(pb, din, dout, true, Init::Normal { std: 0.02 })
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = t.pp(format!("encoder.layers.{i}"));
            let a = l.pp("self_attn");
            layers.push(Layer {
                ln1: Norm::layer(&l.pp("layer_norm1"), d, cfg.layer_norm_eps)?,
                q: lin(&a.pp("q_proj"), d, d)?,
                k: lin(&a.pp("k_proj"), d, d)?,
                v: lin(&a.pp("v_proj"), d, d)?,
                o: lin(&a.pp("out_proj"), d, d)?,
                ln2: Norm::layer(&l.pp("layer_norm2"), d, cfg.layer_norm_eps)?,
                fc1: lin(&l.pp("mlp.fc1"), d, cfg.intermediate_size)?,
                fc2: lin(&l.pp("mlp.fc2"), cfg.intermediate_size, d)?,
            });
        }
        let final_ln = Norm::layer(&t.pp("final_layer_norm"), d, cfg.layer_norm_eps)?;
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
            let a = attention::attend(&q, &k, &v, Some(&causal), (hd as f64).powf(-0.5))?;
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
