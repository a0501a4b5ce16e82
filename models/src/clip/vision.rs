//! The CLIP vision tower (CLIPVisionModelWithProjection; Hugging Face tensor names): patch
//! embedding, class token and positions, pre-LN layers without a mask, the class token's
//! post-normed feature projected to the shared embedding space (`image_embeds`). Also the
//! resize, center crop and normalisation that turn images into its input.

use candle_core::{DType, IndexOp, Tensor};
use ft_kernels::linear;
use ft_params::{Init, ParamBuilder};

use super::encoder::{Act, Encoder, Sizes};
use super::vision_config::{ClipImageNorm, ClipVisionConfig};
use crate::error::{ModelError, Result};
use crate::layers::Norm;

/// What the tower returns.
pub struct ClipVisionOutput {
    /// The last layer's output [B, 1 + patches, D] (no final norm).
    pub last_hidden_state: Tensor,
    /// The projected class-token feature [B, projection_dim].
    pub image_embeds: Tensor,
}

/// CLIPVisionModelWithProjection.
pub struct ClipVisionModel {
    cfg: ClipVisionConfig,
    class: Tensor,
    /// The patch convolution's kernel as a matrix [D, C * P * P] (stride = kernel: a matmul).
    patch: Tensor,
    position: Tensor,
    pre_ln: Norm,
    encoder: Encoder,
    post_ln: Norm,
    projection: Tensor,
}

impl ClipVisionModel {
    pub fn new(pb: &ParamBuilder, cfg: &ClipVisionConfig) -> Result<Self> {
        cfg.validate().map_err(ModelError::Invalid)?;
        let (d, c, p) = (cfg.hidden_size, cfg.num_channels, cfg.patch_size);
        let v = pb.pp("vision_model");
        let e = v.pp("embeddings");
        let class = e.get(&[d], "class_embedding", Init::Normal { std: 0.02 })?;
        let patch = e
            .pp("patch_embedding")
            .get(&[d, c, p, p], "weight", Init::Normal { std: 0.02 })?
            .reshape((d, c * p * p))?;
        let position = e.pp("position_embedding").get(
            &[cfg.grid() * cfg.grid() + 1, d],
            "weight",
            Init::Normal { std: 0.02 },
        )?;
        let encoder = Encoder::new(
            &v.pp("encoder"),
            &Sizes {
                hidden: d,
                intermediate: cfg.intermediate_size,
                layers: cfg.num_hidden_layers,
                heads: cfg.num_attention_heads,
                eps: cfg.layer_norm_eps,
                act: Act::parse(&cfg.hidden_act).map_err(ModelError::Invalid)?,
            },
        )?;
        Ok(ClipVisionModel {
            cfg: cfg.clone(),
            class,
            patch,
            position,
            // transformers' name, typo included.
            pre_ln: Norm::layer(&v.pp("pre_layrnorm"), d, cfg.layer_norm_eps)?,
            encoder,
            post_ln: Norm::layer(&v.pp("post_layernorm"), d, cfg.layer_norm_eps)?,
            projection: pb.pp("visual_projection").get(
                &[cfg.projection_dim, d],
                "weight",
                Init::Normal { std: 0.02 },
            )?,
        })
    }

    pub fn config(&self) -> &ClipVisionConfig {
        &self.cfg
    }

    /// Encodes normalised pixels [B, C, S, S] (S = image_size).
    pub fn forward(&self, pixels: &Tensor) -> Result<ClipVisionOutput> {
        let (b, c, h, w) = pixels.dims4()?;
        let (s, p, g) = (self.cfg.image_size, self.cfg.patch_size, self.cfg.grid());
        if (c, h, w) != (self.cfg.num_channels, s, s) {
            return Err(ModelError::Invalid(format!(
                "pixels of shape {:?}: the vision tower takes [B, {}, {s}, {s}]",
                pixels.dims(),
                self.cfg.num_channels
            )));
        }
        let d = self.cfg.hidden_size;
        let pixels = pixels.to_dtype(self.patch.dtype())?;
        // Patches as rows [B, g*g, C*P*P] in the kernel's (c, y, x) order.
        let rows = pixels
            .reshape((b, c, g, p, g, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .contiguous()?
            .reshape((b, g * g, c * p * p))?;
        let patches = linear::linear(&rows, &self.patch, None)?;
        let class = self.class.reshape((1, 1, d))?.broadcast_as((b, 1, d))?;
        let x = Tensor::cat(&[&class.contiguous()?, &patches], 1)?
            .broadcast_add(&self.position.unsqueeze(0)?)?;
        let x = self.pre_ln.forward(&x)?;
        let mut hidden = Vec::new();
        let last = self.encoder.forward(x, None, &mut hidden)?;
        let pooled = self.post_ln.forward(&last.i((.., 0))?)?;
        let image_embeds = linear::linear(&pooled, &self.projection, None)?;
        Ok(ClipVisionOutput {
            last_hidden_state: last,
            image_embeds,
        })
    }

    /// Images [B, 3, H, W] in [-1, 1] (a VAE's output) as the tower's input: the shorter side
    /// resized to image_size (bilinear, antialiased when shrinking, as torch's
    /// `interpolate(..., antialias=True)`), the center cropped square, normalised by `norm`.
    pub fn preprocess(&self, images: &Tensor, norm: &ClipImageNorm) -> Result<Tensor> {
        let (_, c, h, w) = images.dims4()?;
        if c != 3 {
            return Err(ModelError::Invalid(format!(
                "images of {c} channels: CLIP's preprocessing takes RGB"
            )));
        }
        let s = self.cfg.image_size;
        let short = h.min(w);
        let (rh, rw) = (
            ((h * s) as f64 / short as f64).round() as usize,
            ((w * s) as f64 / short as f64).round() as usize,
        );
        let dev = images.device();
        let rows = Tensor::from_vec(resize_weights(h, rh, (rh - s) / 2, s), (s, h), dev)?;
        let cols = Tensor::from_vec(resize_weights(w, rw, (rw - s) / 2, s), (s, w), dev)?;
        let x = ((images.to_dtype(DType::F32)? + 1.0)? * 0.5)?;
        let x = x.broadcast_matmul(&cols.t()?)?;
        let x = rows.broadcast_matmul(&x)?;
        let mean = Tensor::new(&norm.mean.map(|v| v as f32), dev)?.reshape((1, 3, 1, 1))?;
        let std = Tensor::new(&norm.std.map(|v| v as f32), dev)?.reshape((1, 3, 1, 1))?;
        Ok(x.broadcast_sub(&mean)?
            .broadcast_div(&std)?
            .to_dtype(self.projection.dtype())?)
    }
}

/// The [take, input] matrix of a 1-D bilinear resize from `input` to `output` samples (rows
/// `first..first + take` of it): a triangle filter widened by the shrink factor, as PIL and
/// torch's antialiased interpolation, each row summing to 1.
fn resize_weights(input: usize, output: usize, first: usize, take: usize) -> Vec<f32> {
    let scale = input as f64 / output as f64;
    let support = scale.max(1.0);
    let mut m = vec![0f32; take * input];
    for (r, o) in (first..first + take).enumerate() {
        let center = (o as f64 + 0.5) * scale;
        let lo = ((center - support + 0.5).floor().max(0.0)) as usize;
        let hi = ((center + support + 0.5).floor() as usize).min(input);
        let weights: Vec<f64> = (lo..hi)
            .map(|j| (1.0 - ((j as f64 - center + 0.5) / support).abs()).max(0.0))
            .collect();
        let total: f64 = weights.iter().sum();
        for (j, wt) in (lo..hi).zip(weights) {
            m[r * input + j] = (wt / total) as f32;
        }
    }
    m
}
