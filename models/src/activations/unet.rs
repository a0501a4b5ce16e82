//! The UNet's activations, mirroring `UNet::forward` block by block.

use candle_core::DType;
use ft_params::checkpoint::{ActivationProfile, SegmentBytes, Temporaries};

use super::{Attention, Tally, Target};
use crate::unet::UNetConfig;
use ft_kernels::attention::MAX_SCORES;

/// The input of one UNet forward: `batch` latents of `height` x `width` (the image size / 8)
/// and text states of `context_len` tokens (77 for SDXL's CLIP encoders).
#[derive(Clone, Copy, Debug)]
pub struct UNetShape {
    pub batch: usize,
    pub height: usize,
    pub width: usize,
    pub context_len: usize,
}

/// Walks the forward, adding the caller's graph to `outer` and each segment to `segments`.
struct Walk<'a> {
    cfg: &'a UNetConfig,
    b: u64,
    temb: u64,
    ctx: u64,
    dtype: DType,
    target: Target,
    /// Each convolution's bias is a second op ([`Target::bias_op`]).
    bias_op: bool,
    outer: Tally,
    segments: Vec<SegmentBytes>,
}

impl Walk<'_> {
    /// A segment of `t` with `output` elements, copying `inputs` elements as its leaves, with
    /// `scores` elements of backward's temporaries through its attention scores.
    fn segment(&mut self, t: Tally, output: u64, inputs: u64, scores: u64) {
        self.segments
            .push(t.segment(self.dtype, output, inputs, scores));
        // The op's output is a tensor of the caller's graph.
        self.outer.new_tensor(output);
    }

    /// A ResNet block from `cin` to `cout` channels over `hw` pixels.
    fn resnet(&mut self, cin: u64, cout: u64, hw: u64) {
        let (b, mut t) = (self.b, Tally::default());
        t.norm(b * cin * hw); // with its SiLU
        t.conv(b * cout * hw, self.bias_op);
        t.new_tensor(b * self.temb); // silu of the time embedding
        t.linear(b, self.temb, cout, self.bias_op, false);
        t.new_tensor(b * cout); // time embedding + conv bias, added by the conv
        t.norm(b * cout * hw); // with its SiLU
        t.conv(b * cout * hw, self.bias_op);
        if cin != cout {
            t.conv(b * cout * hw, self.bias_op); // 1x1 shortcut
        }
        t.new_tensor(b * cout * hw); // residual sum
                                     // Its leaves: the input and the time embedding.
        self.segment(t, b * cout * hw, b * cin * hw + b * self.temb, 0);
    }

    /// An attention sub-layer of a transformer block: projections, attention, output. Returns
    /// its backward's temporaries through the scores, in elements (0 where the attention does
    /// not form them): [`UNET_SCORE_TEMPORARIES`] of the scores of one query chunk
    /// ([`SEPARATE_SCORE_TEMPORARIES`] where the products and the scale are candle's ops).
    fn attn(&self, t: &mut Tally, d: u64, n: u64, lk: u64, ctx_dim: u64, heads: u64) -> u64 {
        let b = self.b;
        t.linear(b * n, d, d, false, false); // q
        t.linear(b * lk, ctx_dim, d, false, false); // k
        t.linear(b * lk, ctx_dim, d, false, false); // v
        let a = Attention {
            b,
            heads,
            lq: n,
            lk,
            head_dim: d / heads,
            q_view: true,
            v_view: true,
            scaled: true,
            bias: 0,
        };
        t.attention(a, self.target, self.dtype);
        t.new_tensor(b * n * d); // heads merged back
        t.linear(b * n, d, d, self.bias_op, false); // out
        if self.target.fused_attention(a.head_dim) {
            return 0;
        }
        let permille = if self.bias_op {
            SEPARATE_SCORE_TEMPORARIES
        } else {
            UNET_SCORE_TEMPORARIES
        };
        permille * b * heads * lk * a.chunk_rows(MAX_SCORES as u64) / 1000
    }

    /// A transformer block of width `d` over `n` tokens.
    fn transformer_block(&mut self, d: u64, n: u64, heads: u64) {
        let (b, mut t) = (self.b, Tally::default());
        let bnd = b * n * d;
        t.norm(bnd);
        // The two attentions' backward runs one after the other: the block holds the larger
        // one's score temporaries.
        let mut scores = self.attn(&mut t, d, n, n, d, heads);
        t.new_tensor(bnd); // residual
        t.norm(bnd);
        scores = scores.max(self.attn(
            &mut t,
            d,
            n,
            self.ctx,
            self.cfg.cross_attention_dim as u64,
            heads,
        ));
        t.new_tensor(bnd); // residual
        t.norm(bnd);
        t.linear(b * n, d, 8 * d, self.bias_op, false); // GEGLU in
        t.new_tensor(4 * bnd); // value times the gate's GELU, one op
        t.linear(b * n, 4 * d, d, self.bias_op, false); // out
        t.new_tensor(bnd); // residual
                           // Its leaves: the input (the text states are data, no gradient).
        self.segment(t, bnd, bnd, scores);
    }

    /// A Transformer2D: group norm and projection in, its blocks, projection out, residual.
    fn transformer(&mut self, c: u64, hw: u64, level: usize) {
        let n = self.b * c * hw;
        self.outer.norm(n);
        self.outer.linear(self.b * hw, c, c, self.bias_op, true);
        let heads = self.cfg.heads(level) as u64;
        for _ in 0..self.cfg.layers(level) {
            self.transformer_block(c, hw, heads);
        }
        self.outer.linear(self.b * hw, c, c, self.bias_op, false);
        self.outer.new_tensor(n); // back to [B, C, H, W]
        self.outer.new_tensor(n); // residual
    }
}

/// A 3x3 convolution's output side with stride 2 and padding 1.
fn halved(x: usize) -> usize {
    x.div_ceil(2)
}

/// Backward's temporaries through a UNet block besides its attention scores', in thousandths
/// of its graph, and ([`UNET_SCORE_TEMPORARIES`]) through the scores, in thousandths of one
/// attention's scores (of one query chunk; the block's larger attention). Measured by
/// `trainer/tests/backward_temporaries.rs` on two UNets: the tiny fixture's, whose largest
/// blocks are transformer blocks made mostly of scores (256-576 tokens), and sdxl-ft's demo
/// UNet at 64 px, whose transformer blocks see 64 tokens. One factor of the graph could not
/// serve both: a rebuilt block needed 3.1-3.5 graphs on top in the first and 1.6-1.7 in the
/// second (the `--fit` runs of the demo were 14% over their plans under `full`). With the
/// scores apart, fitted by hand on those 20 runs (2026-11-29, after the norms became one op;
/// again after the linear layers and attention's products became one op each on the CPU):
/// predicted peaks 1.3% to 5.6% over the measured ones on the first UNet, 7.9% under to 4.2%
/// over on the demo's (its `every:2` row at batch 2 measured 9.52, 10.46 and 9.91 MiB in
/// three runs of one build: rayon's tasks allocate in either order). On a GPU the attention of
/// 64-wide heads forms no scores, so the factors of the graph alone count there, and the linear
/// layers are candle's matmul and bias add: [`SEPARATE_BIAS_TEMPORARIES`] (not measured on a
/// GPU yet).
const UNET_TEMPORARIES: Temporaries = Temporaries {
    whole: 500,
    kept: 500,
    recomputed: 250,
};

/// [`UNET_TEMPORARIES`] where the linear layers and convolutions add their bias by a second op
/// and attention's products are candle's matmul (`Target::bias_op`: CUDA, and bf16 anywhere):
/// the factors measured on the CPU while it ran those ops too (rows within -2.1% to +6.2%
/// then). With the one-op layers, these overshot `none` by 6-11% and `full` by up to 24%.
const SEPARATE_BIAS_TEMPORARIES: Temporaries = Temporaries {
    whole: 1000,
    kept: 250,
    recomputed: 250,
};

/// See [`UNET_TEMPORARIES`]; T5's fit (no scale) found 7.5 with candle's products and 8.5 with
/// the batched op ([`super::t5`]). Less here than with a separate scale (no scaled copy and no
/// gradient of it).
const UNET_SCORE_TEMPORARIES: u64 = 6000;

/// [`UNET_SCORE_TEMPORARIES`] with candle's products and a separate scale, as measured with them.
const SEPARATE_SCORE_TEMPORARIES: u64 = 8000;

impl UNetConfig {
    /// What one forward at `shape` keeps for its backward, in `dtype`, with attention as it
    /// runs on `target`: the caller's graph up to the UNet's output (the loss comes on top) and each
    /// checkpoint segment (every ResNet block and transformer layer), in forward order.
    pub fn activations(
        &self,
        shape: &UNetShape,
        dtype: DType,
        target: Target,
    ) -> ActivationProfile {
        let ch: Vec<u64> = self.block_out_channels.iter().map(|&c| c as u64).collect();
        let levels = ch.len();
        let b = shape.batch as u64;
        let temb = 4 * ch[0];
        let mut w = Walk {
            cfg: self,
            b,
            temb,
            ctx: shape.context_len as u64,
            dtype,
            target,
            bias_op: target.bias_op(dtype),
            outer: Tally::default(),
            segments: Vec::new(),
        };
        // Time embedding (two linears around a silu), and SDXL's added embedding summed in.
        let bias_op = w.bias_op;
        w.outer.linear(b, ch[0], temb, bias_op, false);
        w.outer.new_tensor(b * temb);
        w.outer.linear(b, temb, temb, bias_op, false);
        if self.addition_embed_type.is_some() {
            let pin = self.projection_class_embeddings_input_dim.unwrap_or(0) as u64;
            w.outer.linear(b, pin, temb, bias_op, false);
            w.outer.new_tensor(b * temb);
            w.outer.linear(b, temb, temb, bias_op, false);
            w.outer.new_tensor(b * temb);
        }
        let (mut h, mut wd) = (shape.height, shape.width);
        let px = |h: usize, w: usize| (h * w) as u64;
        w.outer.conv(b * ch[0] * px(h, wd), bias_op);
        let mut skips = vec![ch[0]];
        let mut cin = ch[0];
        for (i, &c) in ch.iter().enumerate() {
            let cross = self.down_block_types[i].starts_with("CrossAttn");
            for _ in 0..self.layers_per_block {
                w.resnet(cin, c, px(h, wd));
                if cross {
                    w.transformer(c, px(h, wd), i);
                }
                skips.push(c);
                cin = c;
            }
            if i + 1 < levels {
                (h, wd) = (halved(h), halved(wd));
                w.outer.conv(b * c * px(h, wd), bias_op);
                skips.push(c);
            }
        }
        let top = ch[levels - 1];
        w.resnet(top, top, px(h, wd));
        w.transformer(top, px(h, wd), levels - 1);
        w.resnet(top, top, px(h, wd));
        let mut prev = top;
        for i in 0..levels {
            let c = ch[levels - 1 - i];
            let cross = self.up_block_types[i].starts_with("CrossAttn");
            for _ in 0..=self.layers_per_block {
                let s = skips.pop().unwrap_or(0);
                w.outer.new_tensor(b * (prev + s) * px(h, wd)); // concatenated skip
                w.resnet(prev + s, c, px(h, wd));
                if cross {
                    w.transformer(c, px(h, wd), levels - 1 - i);
                }
                prev = c;
            }
            if i + 1 < levels {
                w.outer.new_tensor(4 * b * c * px(h, wd)); // nearest 2x upsample
                (h, wd) = (2 * h, 2 * wd);
                w.outer.conv(b * c * px(h, wd), bias_op);
            }
        }
        let n = b * ch[0] * px(h, wd);
        w.outer.norm(n); // with its SiLU
        w.outer
            .conv(b * self.out_channels as u64 * px(h, wd), bias_op);
        ActivationProfile {
            outer: w.outer.bytes(dtype),
            segments: w.segments,
            op_held: 0,
            temporaries: if bias_op {
                SEPARATE_BIAS_TEMPORARIES
            } else {
                UNET_TEMPORARIES
            },
        }
    }
}
