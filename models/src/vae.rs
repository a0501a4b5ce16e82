//! AutoencoderKL (diffusers' `vae/`), frozen in SDXL fine-tuning: the encoder turns images into
//! latents once before training, the decoder turns sampled latents into images, in chunks so an
//! evaluation never decodes a whole batch at once (seed 003's OOM).

use std::path::Path;

use candle_core::Tensor;
use ft_kernels::{attention, upsample};
use ft_params::ParamBuilder;
use serde::Deserialize;

use crate::error::{ModelError, Result};
use crate::layers::{Conv2d as Conv, Linear, Norm};

fn d_ch() -> usize {
    3
}
fn d_blocks() -> Vec<usize> {
    vec![64]
}
fn d_layers() -> usize {
    1
}
fn d_latent() -> usize {
    4
}
fn d_groups() -> usize {
    32
}
fn d_scale() -> f64 {
    0.18215
}

/// `vae/config.json` fields (diffusers' AutoencoderKL).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct VaeConfig {
    #[serde(default = "d_ch")]
    pub in_channels: usize,
    #[serde(default = "d_ch")]
    pub out_channels: usize,
    #[serde(default = "d_blocks")]
    pub block_out_channels: Vec<usize>,
    #[serde(default = "d_layers")]
    pub layers_per_block: usize,
    #[serde(default = "d_latent")]
    pub latent_channels: usize,
    #[serde(default = "d_groups")]
    pub norm_num_groups: usize,
    /// Latents are multiplied by this after encoding (SDXL: 0.13025).
    #[serde(default = "d_scale")]
    pub scaling_factor: f64,
}

impl VaeConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg = crate::error::read_config::<VaeConfig>(path)?;
        if cfg.block_out_channels.is_empty()
            || cfg
                .block_out_channels
                .iter()
                .any(|c| c % cfg.norm_num_groups != 0)
        {
            return Err(ModelError::Config {
                path: path.display().to_string(),
                reason: format!(
                    "block_out_channels {:?} must be non-empty multiples of norm_num_groups {}",
                    cfg.block_out_channels, cfg.norm_num_groups
                ),
            });
        }
        Ok(cfg)
    }
}

struct Resnet {
    norm1: Norm,
    conv1: Conv,
    norm2: Norm,
    conv2: Conv,
    shortcut: Option<Conv>,
}

impl Resnet {
    fn new(pb: &ParamBuilder, cin: usize, cout: usize, groups: usize) -> Result<Self> {
        Ok(Resnet {
            norm1: Norm::group(&pb.pp("norm1"), cin, groups, 1e-6)?,
            conv1: Conv::new(&pb.pp("conv1"), cin, cout, 3, 1, 1)?,
            norm2: Norm::group(&pb.pp("norm2"), cout, groups, 1e-6)?,
            conv2: Conv::new(&pb.pp("conv2"), cout, cout, 3, 1, 1)?,
            shortcut: if cin != cout {
                Some(Conv::new(&pb.pp("conv_shortcut"), cin, cout, 1, 1, 0)?)
            } else {
                None
            },
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.conv1.forward(&self.norm1.forward_silu(x)?)?;
        let h = self.conv2.forward(&self.norm2.forward_silu(&h)?)?;
        let s = match &self.shortcut {
            Some(c) => c.forward(x)?,
            None => x.clone(),
        };
        s + h
    }
}

/// Single-head self-attention over pixels, with a residual (the VAE mid-block's).
struct PixelAttention {
    norm: Norm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
}

impl PixelAttention {
    fn new(pb: &ParamBuilder, c: usize, groups: usize) -> Result<Self> {
        let lin = |name: &str| Linear::new(&pb.pp(name), c, c, true);
        Ok(PixelAttention {
            norm: Norm::group(&pb.pp("group_norm"), c, groups, 1e-6)?,
            q: lin("to_q")?,
            k: lin("to_k")?,
            v: lin("to_v")?,
            o: lin("to_out.0")?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        let t = self
            .norm
            .forward(x)?
            .reshape((b, c, h * w))?
            .transpose(1, 2)?; // [B, HW, C]
        let p = |l: &Linear| -> candle_core::Result<Tensor> { l.forward(&t)?.unsqueeze(1) };
        let a = attention::attend(
            &p(&self.q)?,
            &p(&self.k)?,
            &p(&self.v)?,
            None,
            (c as f64).powf(-0.5),
        )?
        .squeeze(1)?;
        let out = self.o.forward(&a)?.transpose(1, 2)?.reshape((b, c, h, w))?;
        x + out
    }
}

struct Mid {
    r0: Resnet,
    attn: PixelAttention,
    r1: Resnet,
}

impl Mid {
    fn new(pb: &ParamBuilder, c: usize, g: usize) -> Result<Self> {
        Ok(Mid {
            r0: Resnet::new(&pb.pp("resnets.0"), c, c, g)?,
            attn: PixelAttention::new(&pb.pp("attentions.0"), c, g)?,
            r1: Resnet::new(&pb.pp("resnets.1"), c, c, g)?,
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.r1.forward(&self.attn.forward(&self.r0.forward(x)?)?)
    }
}

struct Stage {
    resnets: Vec<Resnet>,
    /// Encoder: stride-2 conv after (0, 1, 0, 1) padding. Decoder: nearest x2 then conv.
    resample: Option<Conv>,
}

/// The encoder half: images to the latent distribution's moments.
struct Encoder {
    conv_in: Conv,
    stages: Vec<Stage>,
    mid: Mid,
    norm: Norm,
    conv_out: Conv,
    quant: Conv,
}

/// The decoder half: latents to images.
struct Decoder {
    post_quant: Conv,
    conv_in: Conv,
    mid: Mid,
    stages: Vec<Stage>,
    norm: Norm,
    conv_out: Conv,
}

/// Which halves of the VAE to load. Fine-tuning needs the encoder only while the latent cache is
/// built and the decoder only for evaluation samples, so each is loaded when it is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VaeParts {
    Both,
    Encoder,
    Decoder,
}

/// AutoencoderKL with diffusers' tensor names.
pub struct Vae {
    cfg: VaeConfig,
    encoder: Option<Encoder>,
    decoder: Option<Decoder>,
}

impl Vae {
    pub fn new(pb: &ParamBuilder, cfg: &VaeConfig) -> Result<Self> {
        Self::with_parts(pb, cfg, VaeParts::Both)
    }

    /// Builds (loads) only the halves in `parts`.
    pub fn with_parts(pb: &ParamBuilder, cfg: &VaeConfig, parts: VaeParts) -> Result<Self> {
        let ch = &cfg.block_out_channels;
        if ch.is_empty() {
            return Err(ModelError::Invalid(
                "vae block_out_channels is empty".into(),
            ));
        }
        let g = cfg.norm_num_groups;
        let top = ch[ch.len() - 1];
        let lc = cfg.latent_channels;
        let encoder = if parts != VaeParts::Decoder {
            let e = pb.pp("encoder");
            let mut stages = Vec::new();
            let mut cin = ch[0];
            for (i, &c) in ch.iter().enumerate() {
                let bp = e.pp(format!("down_blocks.{i}"));
                let mut resnets = Vec::new();
                for j in 0..cfg.layers_per_block {
                    resnets.push(Resnet::new(
                        &bp.pp(format!("resnets.{j}")),
                        if j == 0 { cin } else { c },
                        c,
                        g,
                    )?);
                }
                let resample = if i + 1 < ch.len() {
                    Some(Conv::new(&bp.pp("downsamplers.0.conv"), c, c, 3, 2, 0)?)
                } else {
                    None
                };
                stages.push(Stage { resnets, resample });
                cin = c;
            }
            Some(Encoder {
                conv_in: Conv::new(&e.pp("conv_in"), cfg.in_channels, ch[0], 3, 1, 1)?,
                stages,
                mid: Mid::new(&e.pp("mid_block"), top, g)?,
                norm: Norm::group(&e.pp("conv_norm_out"), top, g, 1e-6)?,
                conv_out: Conv::new(&e.pp("conv_out"), top, 2 * lc, 3, 1, 1)?,
                quant: Conv::new(&pb.pp("quant_conv"), 2 * lc, 2 * lc, 1, 1, 0)?,
            })
        } else {
            None
        };
        let decoder = if parts != VaeParts::Encoder {
            let d = pb.pp("decoder");
            let mut stages = Vec::new();
            let rev: Vec<usize> = ch.iter().rev().copied().collect();
            let mut cin = top;
            for (i, &c) in rev.iter().enumerate() {
                let bp = d.pp(format!("up_blocks.{i}"));
                let mut resnets = Vec::new();
                for j in 0..=cfg.layers_per_block {
                    resnets.push(Resnet::new(
                        &bp.pp(format!("resnets.{j}")),
                        if j == 0 { cin } else { c },
                        c,
                        g,
                    )?);
                }
                let resample = if i + 1 < rev.len() {
                    Some(Conv::new(&bp.pp("upsamplers.0.conv"), c, c, 3, 1, 1)?)
                } else {
                    None
                };
                stages.push(Stage { resnets, resample });
                cin = c;
            }
            Some(Decoder {
                post_quant: Conv::new(&pb.pp("post_quant_conv"), lc, lc, 1, 1, 0)?,
                conv_in: Conv::new(&d.pp("conv_in"), lc, top, 3, 1, 1)?,
                mid: Mid::new(&d.pp("mid_block"), top, g)?,
                stages,
                norm: Norm::group(&d.pp("conv_norm_out"), ch[0], g, 1e-6)?,
                conv_out: Conv::new(&d.pp("conv_out"), ch[0], cfg.out_channels, 3, 1, 1)?,
            })
        } else {
            None
        };
        Ok(Vae {
            cfg: cfg.clone(),
            encoder,
            decoder,
        })
    }

    pub fn config(&self) -> &VaeConfig {
        &self.cfg
    }

    /// Mean and log-variance of the latent distribution [B, latent_channels, H/f, W/f], unscaled.
    pub fn encode_moments(&self, images: &Tensor) -> Result<(Tensor, Tensor)> {
        let e = self
            .encoder
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("this VAE was loaded without its encoder".into()))?;
        let mut h = e.conv_in.forward(images)?;
        for s in &e.stages {
            for r in &s.resnets {
                h = r.forward(&h)?;
            }
            if let Some(c) = &s.resample {
                h = c.forward(&h.pad_with_zeros(2, 0, 1)?.pad_with_zeros(3, 0, 1)?)?;
            }
        }
        let h = e.mid.forward(&h)?;
        let h = e.conv_out.forward(&e.norm.forward_silu(&h)?)?;
        let m = e.quant.forward(&h)?;
        let lc = self.cfg.latent_channels;
        Ok((
            m.narrow(1, 0, lc)?,
            m.narrow(1, lc, lc)?.clamp(-30f32, 20f32)?,
        ))
    }

    /// Training latents: the posterior mean times `scaling_factor` (deterministic, so a latent
    /// cache is reproducible; sampling adds `exp(logvar / 2) * noise`).
    pub fn encode(&self, images: &Tensor) -> Result<Tensor> {
        let (mean, _) = self.encode_moments(images)?;
        Ok((mean * self.cfg.scaling_factor)?)
    }

    /// Images from scaled latents (divided by `scaling_factor` first).
    pub fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        let d = self
            .decoder
            .as_ref()
            .ok_or_else(|| ModelError::Invalid("this VAE was loaded without its decoder".into()))?;
        let z = (latents / self.cfg.scaling_factor)?;
        let mut h = d.conv_in.forward(&d.post_quant.forward(&z)?)?;
        h = d.mid.forward(&h)?;
        for s in &d.stages {
            for r in &s.resnets {
                h = r.forward(&h)?;
            }
            if let Some(c) = &s.resample {
                h = c.forward(&upsample::upsample_nearest2x(&h)?)?;
            }
        }
        Ok(d.conv_out.forward(&d.norm.forward_silu(&h)?)?)
    }

    /// Decodes in overlapping spatial tiles of `tile` latent pixels (diffusers' `enable_tiling`:
    /// tiles advance by 75% of their size and the overlapping 25% of the decoded images is blended
    /// linearly, first with the tile above, then with the tile to the left). Each decoded tile is
    /// moved to the host at once, so the device holds one tile's activations, however large the
    /// image. Like diffusers', the result approximates whole-image decoding (the decoder's
    /// mid-block attention sees one tile); with `tile` at least the latent size it is exact.
    pub fn decode_tiled(&self, latents: &Tensor, tile: usize) -> Result<Tensor> {
        let (_, _, h, w) = latents.dims4()?;
        if tile == 0 || (h <= tile && w <= tile) {
            return Ok(self.decode(latents)?.to_device(&candle_core::Device::Cpu)?);
        }
        let factor = 1usize << (self.cfg.block_out_channels.len() - 1);
        let stride = ((tile as f64) * 0.75) as usize;
        let sample = tile * factor;
        let blend = ((sample as f64) * 0.25) as usize;
        let limit = sample - blend;
        if stride == 0 || blend == 0 {
            return Err(ModelError::Invalid(format!(
                "VAE tile of {tile} latent pixels is too small to overlap"
            )));
        }
        let mut rows: Vec<Vec<Tensor>> = Vec::new();
        for i in (0..h).step_by(stride) {
            let mut row = Vec::new();
            for j in (0..w).step_by(stride) {
                let z = latents
                    .narrow(2, i, tile.min(h - i))?
                    .narrow(3, j, tile.min(w - j))?;
                row.push(self.decode(&z)?.to_device(&candle_core::Device::Cpu)?);
            }
            rows.push(row);
        }
        let mut out_rows = Vec::with_capacity(rows.len());
        for i in 0..rows.len() {
            let mut parts = Vec::with_capacity(rows[i].len());
            for j in 0..rows[i].len() {
                let mut t = rows[i][j].clone();
                if i > 0 {
                    t = blend_edge(&rows[i - 1][j], &t, blend, 2)?;
                }
                if j > 0 {
                    t = blend_edge(&rows[i][j - 1], &t, blend, 3)?;
                }
                // Later tiles blend with this one as blended (diffusers updates it in place).
                rows[i][j] = t.clone();
                let (th, tw) = (t.dim(2)?, t.dim(3)?);
                parts.push(t.narrow(2, 0, limit.min(th))?.narrow(3, 0, limit.min(tw))?);
            }
            out_rows.push(Tensor::cat(&parts, 3)?);
        }
        Ok(Tensor::cat(&out_rows, 2)?)
    }

    /// Decodes `chunk` latents at a time, moving each decoded chunk to the host before the next
    /// (evaluation never holds a whole batch of full-resolution activations); each chunk in
    /// spatial tiles of `tile` latent pixels when `tile` > 0 ([`Vae::decode_tiled`]).
    pub fn decode_chunked(&self, latents: &Tensor, chunk: usize, tile: usize) -> Result<Tensor> {
        let n = latents.dim(0)?;
        let mut parts = Vec::new();
        let mut i = 0;
        while i < n {
            let len = chunk.max(1).min(n - i);
            parts.push(self.decode_tiled(&latents.narrow(0, i, len)?, tile)?);
            i += len;
        }
        Ok(Tensor::cat(&parts, 0)?)
    }
}

/// `b` with its first `extent` rows (dim 2) or columns (dim 3) faded in from the last ones of `a`:
/// `a[-extent + y] * (1 - y / extent) + b[y] * (y / extent)`.
fn blend_edge(a: &Tensor, b: &Tensor, extent: usize, dim: usize) -> Result<Tensor> {
    let e = extent.min(a.dim(dim)?).min(b.dim(dim)?);
    if e == 0 {
        return Ok(b.clone());
    }
    let w: Vec<f32> = (0..e).map(|y| y as f32 / e as f32).collect();
    let mut shape = vec![1usize; 4];
    shape[dim] = e;
    let w = Tensor::from_vec(w, shape, b.device())?.to_dtype(b.dtype())?;
    let tail = a.narrow(dim, a.dim(dim)? - e, e)?;
    let head = b.narrow(dim, 0, e)?;
    let mixed = (tail.broadcast_mul(&(1.0 - &w)?)? + head.broadcast_mul(&w)?)?;
    let rest = b.narrow(dim, e, b.dim(dim)? - e)?;
    Ok(Tensor::cat(&[&mixed, &rest], dim)?)
}
