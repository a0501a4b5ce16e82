//! SDXL's UNet2DConditionModel (diffusers names and config): time and `text_time` added
//! embeddings, ResNet blocks with time conditioning, Transformer2D blocks with linear projections
//! (self-attention, cross-attention to the text states, GEGLU feed-forward), skip connections.
//! Per-sample timesteps. Each ResNet and transformer block can be a checkpoint segment.

use std::path::Path;
use std::sync::Arc;

use candle_core::{Tensor, Var};
use ft_kernels::activation::{silu, Activation};
use ft_kernels::gated::gated_halves;
use ft_kernels::{attention, upsample};
use ft_params::checkpoint::{Checkpointer, SegmentFn};
use ft_params::ParamBuilder;
use serde::Deserialize;

use crate::error::{ModelError, Result};
use crate::layers::{Conv2d as Conv, Linear as Lin, Norm};

fn d_groups() -> usize {
    32
}
fn d_eps() -> f64 {
    1e-5
}
fn d_four() -> usize {
    4
}
fn d_two() -> usize {
    2
}

/// Either one value for every level or one per level (diffusers accepts both).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum PerLevel {
    One(usize),
    Each(Vec<usize>),
}

impl PerLevel {
    fn at(&self, i: usize) -> usize {
        match self {
            PerLevel::One(v) => *v,
            PerLevel::Each(v) => v.get(i).copied().unwrap_or(1),
        }
    }
}

/// `unet/config.json` fields used by SDXL.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct UNetConfig {
    #[serde(default = "d_four")]
    pub in_channels: usize,
    #[serde(default = "d_four")]
    pub out_channels: usize,
    pub block_out_channels: Vec<usize>,
    pub down_block_types: Vec<String>,
    pub up_block_types: Vec<String>,
    #[serde(default = "d_two")]
    pub layers_per_block: usize,
    /// Heads per level (diffusers' historical name; `num_attention_heads` wins when set).
    pub attention_head_dim: PerLevel,
    #[serde(default)]
    pub num_attention_heads: Option<PerLevel>,
    pub transformer_layers_per_block: Option<PerLevel>,
    pub cross_attention_dim: usize,
    #[serde(default = "d_groups")]
    pub norm_num_groups: usize,
    #[serde(default = "d_eps")]
    pub norm_eps: f64,
    #[serde(default)]
    pub addition_embed_type: Option<String>,
    #[serde(default)]
    pub addition_time_embed_dim: Option<usize>,
    #[serde(default)]
    pub projection_class_embeddings_input_dim: Option<usize>,
}

impl UNetConfig {
    /// Reads `unet/config.json`; a value the model cannot be built with is an error naming the
    /// file and the field.
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg: Self = crate::error::read_config(path)?;
        cfg.check().map_err(|reason| ModelError::Config {
            path: path.display().to_string(),
            reason,
        })?;
        Ok(cfg)
    }

    /// What makes a config unbuildable (where the model would divide by zero or reshape
    /// wrongly): empty or zero channel counts, a head count of zero or one that does not divide
    /// its level's channels, groups that do not divide them.
    pub fn check(&self) -> std::result::Result<(), String> {
        let ch = &self.block_out_channels;
        if ch.is_empty() || ch.contains(&0) {
            return Err(format!(
                "block_out_channels {ch:?}: at least one level, none of 0"
            ));
        }
        if self.layers_per_block == 0 || self.cross_attention_dim == 0 {
            return Err("layers_per_block and cross_attention_dim must be at least 1".into());
        }
        for (i, &c) in ch.iter().enumerate() {
            let heads = self.heads(i);
            if heads == 0 || !c.is_multiple_of(heads) {
                return Err(format!(
                    "attention heads {heads} at level {i} (attention_head_dim / \
                     num_attention_heads): must be at least 1 and divide the level's {c} channels"
                ));
            }
            if self.norm_num_groups == 0 || !c.is_multiple_of(self.norm_num_groups) {
                return Err(format!(
                    "norm_num_groups {} must divide every level's channels (level {i}: {c})",
                    self.norm_num_groups
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn heads(&self, i: usize) -> usize {
        self.num_attention_heads
            .as_ref()
            .unwrap_or(&self.attention_head_dim)
            .at(i)
    }

    pub(crate) fn layers(&self, i: usize) -> usize {
        self.transformer_layers_per_block
            .as_ref()
            .map(|p| p.at(i))
            .unwrap_or(1)
    }
}

/// diffusers' `get_timestep_embedding` with `flip_sin_to_cos=True, downscale_freq_shift=0`:
/// [cos(t w), sin(t w)] with w_k = exp(-ln(10000) k / half).
pub fn timestep_embedding(t: &[f32], dim: usize, device: &candle_core::Device) -> Result<Tensor> {
    let half = dim / 2;
    let mut v = Vec::with_capacity(t.len() * dim);
    for &ti in t {
        let freqs: Vec<f64> = (0..half)
            .map(|k| (-(10000f64.ln()) * k as f64 / half as f64).exp())
            .collect();
        v.extend(freqs.iter().map(|w| (ti as f64 * w).cos() as f32));
        v.extend(freqs.iter().map(|w| (ti as f64 * w).sin() as f32));
    }
    Ok(Tensor::from_vec(v, (t.len(), half * 2), device)?)
}

#[derive(Clone)]
struct Resnet {
    norm1: Norm,
    conv1: Conv,
    temb: Lin,
    norm2: Norm,
    conv2: Conv,
    shortcut: Option<Conv>,
}

impl Resnet {
    fn new(
        pb: &ParamBuilder,
        cin: usize,
        cout: usize,
        temb: usize,
        cfg: &UNetConfig,
    ) -> Result<Self> {
        let g = cfg.norm_num_groups;
        Ok(Resnet {
            norm1: Norm::group(&pb.pp("norm1"), cin, g, cfg.norm_eps)?,
            conv1: Conv::new(&pb.pp("conv1"), cin, cout, 3, 1, 1)?,
            temb: Lin::new(&pb.pp("time_emb_proj"), temb, cout, true)?,
            norm2: Norm::group(&pb.pp("norm2"), cout, g, cfg.norm_eps)?,
            conv2: Conv::new(&pb.pp("conv2"), cout, cout, 3, 1, 1)?,
            shortcut: if cin != cout {
                Some(Conv::new(&pb.pp("conv_shortcut"), cin, cout, 1, 1, 0)?)
            } else {
                None
            },
        })
    }
    fn forward(&self, x: &Tensor, temb: &Tensor) -> candle_core::Result<Tensor> {
        let t = self.temb.forward(&silu(temb)?)?;
        let h = self
            .conv1
            .forward_shifted(&self.norm1.forward_silu(x)?, &t)?;
        let h = self.conv2.forward(&self.norm2.forward_silu(&h)?)?;
        let s = match &self.shortcut {
            Some(c) => c.forward(x)?,
            None => x.clone(),
        };
        s + h
    }
}

#[derive(Clone)]
struct Attn {
    q: Lin,
    k: Lin,
    v: Lin,
    o: Lin,
    heads: usize,
}

impl Attn {
    fn new(pb: &ParamBuilder, dim: usize, ctx: usize, heads: usize) -> Result<Self> {
        Ok(Attn {
            q: Lin::new(&pb.pp("to_q"), dim, dim, false)?,
            k: Lin::new(&pb.pp("to_k"), ctx, dim, false)?,
            v: Lin::new(&pb.pp("to_v"), ctx, dim, false)?,
            o: Lin::new(&pb.pp("to_out.0"), dim, dim, true)?,
            heads,
        })
    }
    fn forward(&self, x: &Tensor, ctx: &Tensor) -> candle_core::Result<Tensor> {
        let (b, l, d) = x.dims3()?;
        let hd = d / self.heads;
        let split = |t: Tensor| -> candle_core::Result<Tensor> {
            let n = t.dim(1)?;
            t.reshape((b, n, self.heads, hd))?.transpose(1, 2)
        };
        let a = attention::attend(
            &split(self.q.forward(x)?)?,
            &split(self.k.forward(ctx)?)?,
            &split(self.v.forward(ctx)?)?,
            None,
            (hd as f64).powf(-0.5),
        )?;
        self.o.forward(&a.transpose(1, 2)?.reshape((b, l, d))?)
    }
}

#[derive(Clone)]
struct TBlock {
    n1: Norm,
    a1: Attn,
    n2: Norm,
    a2: Attn,
    n3: Norm,
    ff_in: Lin,
    ff_out: Lin,
}

impl TBlock {
    fn new(pb: &ParamBuilder, dim: usize, ctx: usize, heads: usize) -> Result<Self> {
        Ok(TBlock {
            n1: Norm::layer(&pb.pp("norm1"), dim, 1e-5)?,
            a1: Attn::new(&pb.pp("attn1"), dim, dim, heads)?,
            n2: Norm::layer(&pb.pp("norm2"), dim, 1e-5)?,
            a2: Attn::new(&pb.pp("attn2"), dim, ctx, heads)?,
            n3: Norm::layer(&pb.pp("norm3"), dim, 1e-5)?,
            ff_in: Lin::new(&pb.pp("ff.net.0.proj"), dim, dim * 8, true)?,
            ff_out: Lin::new(&pb.pp("ff.net.2"), dim * 4, dim, true)?,
        })
    }
    fn forward(&self, x: &Tensor, ctx: &Tensor) -> candle_core::Result<Tensor> {
        let n = self.n1.forward(x)?;
        let x = (x + self.a1.forward(&n, &n)?)?;
        let x = (&x + self.a2.forward(&self.n2.forward(&x)?, ctx)?)?;
        let h = self.ff_in.forward(&self.n3.forward(&x)?)?;
        // GEGLU: the first half times the GELU of the second, one op (`ft_kernels::gated`).
        let g = gated_halves(&h, Activation::GeluErf)?;
        x + self.ff_out.forward(&g)?
    }
}

#[derive(Clone)]
struct Transformer {
    norm: Norm,
    proj_in: Lin,
    blocks: Vec<TBlock>,
    proj_out: Lin,
}

impl Transformer {
    fn new(
        pb: &ParamBuilder,
        c: usize,
        layers: usize,
        heads: usize,
        cfg: &UNetConfig,
    ) -> Result<Self> {
        Ok(Transformer {
            norm: Norm::group(&pb.pp("norm"), c, cfg.norm_num_groups, 1e-6)?,
            proj_in: Lin::new(&pb.pp("proj_in"), c, c, true)?,
            blocks: (0..layers)
                .map(|i| {
                    TBlock::new(
                        &pb.pp(format!("transformer_blocks.{i}")),
                        c,
                        cfg.cross_attention_dim,
                        heads,
                    )
                })
                .collect::<Result<_>>()?,
            proj_out: Lin::new(&pb.pp("proj_out"), c, c, true)?,
        })
    }
}

/// Runs a ResNet block and transformer blocks, each as a checkpoint segment when enabled.
struct Runner<'a> {
    ck: &'a Checkpointer,
    temb: &'a Tensor,
    ctx: &'a Tensor,
}

fn vars(ts: Vec<Tensor>) -> candle_core::Result<Vec<Var>> {
    ts.iter()
        .filter(|t| t.is_variable())
        .map(Var::from_tensor)
        .collect()
}

impl Resnet {
    /// The tensors its checkpoint segment uses.
    fn segment_tensors(&self) -> Vec<Tensor> {
        let mut ts = self.norm1.tensors();
        ts.extend(self.conv1.tensors());
        ts.extend(self.norm2.tensors());
        ts.extend(self.conv2.tensors());
        ts.extend(self.temb.tensors());
        if let Some(c) = &self.shortcut {
            ts.extend(c.tensors());
        }
        ts
    }
}

impl TBlock {
    /// The tensors its checkpoint segment uses.
    fn segment_tensors(&self) -> Vec<Tensor> {
        let mut ts = Vec::new();
        for n in [&self.n1, &self.n2, &self.n3] {
            ts.extend(n.tensors());
        }
        for a in [&self.a1, &self.a2] {
            for l in [&a.q, &a.k, &a.v, &a.o] {
                ts.extend(l.tensors());
            }
        }
        ts.extend(self.ff_in.tensors());
        ts.extend(self.ff_out.tensors());
        ts
    }
}

impl Runner<'_> {
    fn resnet(&self, r: &Resnet, x: &Tensor) -> Result<Tensor> {
        let rr = r.clone();
        let f: SegmentFn = Arc::new(move |xs: &[Tensor]| rr.forward(&xs[0], &xs[1]));
        Ok(self
            .ck
            .run(f, &[x, self.temb], &vars(r.segment_tensors())?)?)
    }

    fn transformer(&self, t: &Transformer, x: &Tensor) -> Result<Tensor> {
        let (b, c, h, w) = x.dims4()?;
        let mut s = t
            .proj_in
            .forward(&t.norm.forward(x)?.reshape((b, c, h * w))?.transpose(1, 2)?)?;
        for blk in &t.blocks {
            let bb = blk.clone();
            let f: SegmentFn = Arc::new(move |xs: &[Tensor]| bb.forward(&xs[0], &xs[1]));
            s = self
                .ck
                .run(f, &[&s, self.ctx], &vars(blk.segment_tensors())?)?;
        }
        let out = t
            .proj_out
            .forward(&s)?
            .transpose(1, 2)?
            .reshape((b, c, h, w))?;
        Ok(self.ck.cut((out + x)?))
    }
}

struct Level {
    resnets: Vec<Resnet>,
    attns: Vec<Transformer>,
    resample: Option<Conv>,
}

/// The SDXL UNet.
pub struct UNet {
    cfg: UNetConfig,
    conv_in: Conv,
    t1: Lin,
    t2: Lin,
    add: Option<(Lin, Lin, usize)>,
    down: Vec<Level>,
    mid: (Resnet, Transformer, Resnet),
    up: Vec<Level>,
    norm_out: Norm,
    conv_out: Conv,
}

impl UNet {
    pub fn new(pb: &ParamBuilder, cfg: &UNetConfig) -> Result<Self> {
        cfg.check().map_err(ModelError::Invalid)?;
        let ch = &cfg.block_out_channels;
        let n = ch.len();
        if cfg.down_block_types.len() != n || cfg.up_block_types.len() != n {
            return Err(ModelError::Invalid(
                "down/up block types must match block_out_channels".into(),
            ));
        }
        let temb = ch[0] * 4;
        let cross = |t: &str| t.starts_with("CrossAttn");
        let mut down = Vec::new();
        let mut cin = ch[0];
        for (i, &c) in ch.iter().enumerate() {
            let p = pb.pp(format!("down_blocks.{i}"));
            let mut resnets = Vec::new();
            let mut attns = Vec::new();
            for j in 0..cfg.layers_per_block {
                resnets.push(Resnet::new(
                    &p.pp(format!("resnets.{j}")),
                    if j == 0 { cin } else { c },
                    c,
                    temb,
                    cfg,
                )?);
                if cross(&cfg.down_block_types[i]) {
                    attns.push(Transformer::new(
                        &p.pp(format!("attentions.{j}")),
                        c,
                        cfg.layers(i),
                        cfg.heads(i),
                        cfg,
                    )?);
                }
            }
            let resample = if i + 1 < n {
                Some(Conv::new(&p.pp("downsamplers.0.conv"), c, c, 3, 2, 1)?)
            } else {
                None
            };
            down.push(Level {
                resnets,
                attns,
                resample,
            });
            cin = c;
        }
        let top = ch[n - 1];
        let mp = pb.pp("mid_block");
        let mid = (
            Resnet::new(&mp.pp("resnets.0"), top, top, temb, cfg)?,
            Transformer::new(
                &mp.pp("attentions.0"),
                top,
                cfg.layers(n - 1),
                cfg.heads(n - 1),
                cfg,
            )?,
            Resnet::new(&mp.pp("resnets.1"), top, top, temb, cfg)?,
        );
        let rev: Vec<usize> = ch.iter().rev().copied().collect();
        let mut up = Vec::new();
        let mut prev = rev[0];
        for i in 0..n {
            let p = pb.pp(format!("up_blocks.{i}"));
            let (c, input) = (rev[i], rev[(i + 1).min(n - 1)]);
            let level = n - 1 - i;
            let mut resnets = Vec::new();
            let mut attns = Vec::new();
            for j in 0..=cfg.layers_per_block {
                let skip = if j == cfg.layers_per_block { input } else { c };
                let rin = if j == 0 { prev } else { c };
                resnets.push(Resnet::new(
                    &p.pp(format!("resnets.{j}")),
                    rin + skip,
                    c,
                    temb,
                    cfg,
                )?);
                if cross(&cfg.up_block_types[i]) {
                    attns.push(Transformer::new(
                        &p.pp(format!("attentions.{j}")),
                        c,
                        cfg.layers(level),
                        cfg.heads(level),
                        cfg,
                    )?);
                }
            }
            let resample = if i + 1 < n {
                Some(Conv::new(&p.pp("upsamplers.0.conv"), c, c, 3, 1, 1)?)
            } else {
                None
            };
            up.push(Level {
                resnets,
                attns,
                resample,
            });
            prev = c;
        }
        let add = match cfg.addition_embed_type.as_deref() {
            Some("text_time") => {
                let tdim = cfg.addition_time_embed_dim.ok_or_else(|| {
                    ModelError::Invalid("text_time needs addition_time_embed_dim".into())
                })?;
                let pin = cfg.projection_class_embeddings_input_dim.ok_or_else(|| {
                    ModelError::Invalid(
                        "text_time needs projection_class_embeddings_input_dim".into(),
                    )
                })?;
                Some((
                    Lin::new(&pb.pp("add_embedding.linear_1"), pin, temb, true)?,
                    Lin::new(&pb.pp("add_embedding.linear_2"), temb, temb, true)?,
                    tdim,
                ))
            }
            None => None,
            Some(other) => {
                return Err(ModelError::Invalid(format!(
                    "addition_embed_type `{other}` is not supported"
                )))
            }
        };
        Ok(UNet {
            cfg: cfg.clone(),
            conv_in: Conv::new(&pb.pp("conv_in"), cfg.in_channels, ch[0], 3, 1, 1)?,
            t1: Lin::new(&pb.pp("time_embedding.linear_1"), ch[0], temb, true)?,
            t2: Lin::new(&pb.pp("time_embedding.linear_2"), temb, temb, true)?,
            add,
            down,
            mid,
            up,
            norm_out: Norm::group(
                &pb.pp("conv_norm_out"),
                ch[0],
                cfg.norm_num_groups,
                cfg.norm_eps,
            )?,
            conv_out: Conv::new(&pb.pp("conv_out"), ch[0], cfg.out_channels, 3, 1, 1)?,
        })
    }

    pub fn config(&self) -> &UNetConfig {
        &self.cfg
    }

    /// The tensors of each checkpoint segment the forward runs (every ResNet block and every
    /// transformer layer), in the order it runs them, which is the order of the activation
    /// formulas' segments: the plan pairs the two by index (each segment's gradients and
    /// optimizer step in its backward walk; `ParamStore::segments` finds each one's own tensors).
    pub fn segments(&self) -> Vec<Vec<Tensor>> {
        fn transformer(t: &Transformer, out: &mut Vec<Vec<Tensor>>) {
            out.extend(t.blocks.iter().map(|b| b.segment_tensors()));
        }
        fn level(lv: &Level, out: &mut Vec<Vec<Tensor>>) {
            for (j, r) in lv.resnets.iter().enumerate() {
                out.push(r.segment_tensors());
                if let Some(t) = lv.attns.get(j) {
                    transformer(t, out);
                }
            }
        }
        let mut out = Vec::new();
        for lv in &self.down {
            level(lv, &mut out);
        }
        out.push(self.mid.0.segment_tensors());
        transformer(&self.mid.1, &mut out);
        out.push(self.mid.2.segment_tensors());
        for lv in &self.up {
            level(lv, &mut out);
        }
        out
    }

    /// Predicts noise (or v) for latents [B, 4, h, w] at per-sample `timesteps`, conditioned on
    /// text states [B, L, cross_attention_dim] and, for SDXL, pooled text embeddings [B, P] and
    /// time ids [B, 6].
    pub fn forward(
        &self,
        x: &Tensor,
        timesteps: &[f32],
        context: &Tensor,
        added: Option<(&Tensor, &Tensor)>,
        ck: &Checkpointer,
    ) -> Result<Tensor> {
        let dev = x.device();
        let dt = x.dtype();
        let t = timestep_embedding(timesteps, self.cfg.block_out_channels[0], dev)?.to_dtype(dt)?;
        let mut temb = self.t2.forward(&silu(&self.t1.forward(&t)?)?)?;
        if let Some((l1, l2, tdim)) = &self.add {
            let (text_embeds, time_ids) = added.ok_or_else(|| {
                ModelError::Invalid("SDXL's UNet needs text_embeds and time_ids".into())
            })?;
            let b = time_ids.dim(0)?;
            let ids: Vec<f32> = time_ids
                .to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1()?;
            let te = timestep_embedding(&ids, *tdim, dev)?
                .reshape((b, ()))?
                .to_dtype(dt)?;
            let a = Tensor::cat(&[text_embeds, &te], 1)?;
            temb = (temb + l2.forward(&silu(&l1.forward(&a)?)?)?)?;
        }
        let run = Runner {
            ck,
            temb: &temb,
            ctx: context,
        };
        let mut h = ck.cut(self.conv_in.forward(x)?);
        let mut skips = vec![h.clone()];
        for lv in &self.down {
            for (j, r) in lv.resnets.iter().enumerate() {
                h = run.resnet(r, &h)?;
                if let Some(t) = lv.attns.get(j) {
                    h = run.transformer(t, &h)?;
                }
                skips.push(h.clone());
            }
            if let Some(c) = &lv.resample {
                h = ck.cut(c.forward(&h)?);
                skips.push(h.clone());
            }
        }
        h = run.resnet(&self.mid.0, &h)?;
        h = run.transformer(&self.mid.1, &h)?;
        h = run.resnet(&self.mid.2, &h)?;
        for lv in &self.up {
            for (j, r) in lv.resnets.iter().enumerate() {
                let s = skips
                    .pop()
                    .ok_or_else(|| ModelError::Invalid("skip connections exhausted".into()))?;
                h = run.resnet(r, &Tensor::cat(&[&h, &s], 1)?)?;
                if let Some(t) = lv.attns.get(j) {
                    h = run.transformer(t, &h)?;
                }
            }
            if let Some(c) = &lv.resample {
                h = ck.cut(c.forward(&upsample::upsample_nearest2x(&h)?)?);
            }
        }
        Ok(self.conv_out.forward(&self.norm_out.forward_silu(&h)?)?)
    }
}
