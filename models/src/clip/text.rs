//! The CLIP text transformer: token + position embeddings, pre-LN layers with causal
//! self-attention, final layer norm, pooled end-of-text feature, optional projection.

use candle_core::{DType, IndexOp, Tensor};
use ft_kernels::linear;
use ft_params::{Init, ParamBuilder};

use super::encoder::{Act, Encoder, Sizes};
use super::text_config::ClipTextConfig;
use crate::error::{ModelError, Result};
use crate::layers::Norm;

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
    encoder: Encoder,
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
        let encoder = Encoder::new(
            &t.pp("encoder"),
            &Sizes {
                hidden: d,
                intermediate: cfg.intermediate_size,
                layers: cfg.num_hidden_layers,
                heads: cfg.num_attention_heads,
                eps: cfg.layer_norm_eps,
                act: Act::parse(&cfg.hidden_act).map_err(ModelError::Invalid)?,
            },
        )?;
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
            encoder,
            final_ln,
            projection,
        })
    }

    pub fn config(&self) -> &ClipTextConfig {
        &self.cfg
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
        let tok = self
            .token
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, l, d))?;
        let causal: Vec<f32> = (0..l * l)
            .map(|i| if i % l > i / l { f32::MIN } else { 0.0 })
            .collect();
        let x = tok.broadcast_add(&self.position.narrow(0, 0, l)?.unsqueeze(0)?)?;
        let causal = Tensor::from_vec(causal, (1, 1, l, l), x.device())?.to_dtype(x.dtype())?;
        let mut hidden_states = vec![x.clone()];
        let x = self.encoder.forward(x, Some(&causal), &mut hidden_states)?;
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
