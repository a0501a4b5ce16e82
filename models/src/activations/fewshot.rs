//! A few-shot model's activations over one episode, mirroring `Backbone::forward` block by
//! block (each block a checkpoint segment) and the FSCT or ProtoNet head after it.

use candle_core::DType;
use ft_params::checkpoint::{ActivationProfile, SegmentBytes, Temporaries};

use super::{Tally, Target};
use crate::fewshot::backbone::{BasicBlock, Block, ConvBlock, Stem};
use crate::fewshot::head::Fsct;
use crate::fewshot::FewShotModel;
use crate::layers::Conv2d;

/// One training episode: `n_way` classes of `k_shot` support and `n_query` query images, each
/// `image_size` pixels square.
#[derive(Clone, Copy, Debug)]
pub struct EpisodeShape {
    pub n_way: usize,
    pub k_shot: usize,
    pub n_query: usize,
    pub image_size: usize,
}

/// A feature map: `c` channels of `h` x `w` for each of the episode's images.
#[derive(Clone, Copy)]
struct Map {
    c: u64,
    h: u64,
    w: u64,
}

/// `conv`'s output map from `x`.
fn conv_out(conv: &Conv2d, x: Map) -> Map {
    let (cout, k) = (conv.weight.dims()[0] as u64, conv.weight.dims()[2] as u64);
    let (s, p) = (conv.stride as u64, conv.padding as u64);
    Map {
        c: cout,
        h: (x.h + 2 * p - k) / s + 1,
        w: (x.w + 2 * p - k) / s + 1,
    }
}

/// Walks the backbone's blocks over `n` images.
struct Walk {
    n: u64,
    dtype: DType,
    /// Batch norm is one op and a convolution adds its bias inside ([`Target::cpu_op`]).
    cpu_op: bool,
    segments: Vec<SegmentBytes>,
}

impl Walk {
    fn elems(&self, m: Map) -> u64 {
        self.n * m.c * m.h * m.w
    }

    /// `BatchNorm2d` in training over map `m`: one op's output (its statistics are not
    /// tensors), or as candle's ops the batch mean and variance (each a sum and a division per
    /// reduced dimension), the centred input and its square, the normalised, scaled and shifted
    /// output.
    fn batch_norm(&self, t: &mut Tally, m: Map) {
        if self.cpu_op {
            t.new_tensor(self.elems(m));
            return;
        }
        let stats = m.c * m.h * m.w + m.c * m.w + m.c;
        t.new_tensor(4 * stats + 2 * m.c); // means, variance, + eps, sqrt
        t.new_tensor(6 * self.elems(m));
    }

    /// A convolution to map `y` with the batch norm after it. On the CPU the two are one op
    /// (`ft_kernels::conv::ConvBatchNorm`): it keeps the convolution's output beside the graph
    /// ([`SegmentBytes::op_kept`]) and takes the batch norm's weight and bias (and the
    /// convolution's bias) stacked, one more tensor of 2 or 3 values a channel; otherwise the
    /// convolution's output (and its bias sum, where a second op adds it) is the graph's.
    fn conv_before_bn(&self, t: &mut Tally, conv: &Conv2d, y: Map) {
        if self.cpu_op {
            t.op_kept += self.elems(y);
            t.new_tensor((2 + conv.bias.is_some() as u64) * y.c);
        } else {
            t.conv(self.elems(y), conv.bias.is_some());
        }
    }

    /// conv, batch norm, ReLU (on the CPU one op with the ReLU inside: [`Self::conv_before_bn`]).
    fn conv_bn_relu(&self, t: &mut Tally, conv: &Conv2d, x: Map) -> Map {
        let y = conv_out(conv, x);
        self.conv_before_bn(t, conv, y);
        self.batch_norm(t, y);
        if !self.cpu_op {
            t.new_tensor(self.elems(y));
        }
        y
    }

    /// conv, batch norm, ReLU, zero padding by `pad` and a `k` x `k` max pool of stride `s`,
    /// and the elements of backward's temporaries a factor of the graph cannot follow. On the
    /// CPU the four after the conv are one op (`ft_kernels::batch_norm_pool`), which keeps the
    /// pooled map alone and in its backward forms one map of the conv's output size (the
    /// gradient at the ReLU's output, which the batch norm's backward turns into the input's in
    /// place); otherwise the batch norm, the ReLU, each padded copy (one dimension and then the
    /// other) and the pool's output, all in the graph.
    fn conv_bn_relu_pool(
        &self,
        t: &mut Tally,
        conv: &Conv2d,
        x: Map,
        (k, s, pad): (u64, u64, u64),
    ) -> (Map, u64) {
        let y = if self.cpu_op {
            let y = conv_out(conv, x);
            self.conv_before_bn(t, conv, y);
            y
        } else {
            let y = self.conv_bn_relu(t, conv, x);
            if pad > 0 {
                t.new_tensor(self.elems(Map {
                    h: y.h + 2 * pad,
                    ..y
                }));
                t.new_tensor(self.elems(Map {
                    h: y.h + 2 * pad,
                    w: y.w + 2 * pad,
                    ..y
                }));
            }
            y
        };
        let pooled = Map {
            h: (y.h + 2 * pad - k) / s + 1,
            w: (y.w + 2 * pad - k) / s + 1,
            ..y
        };
        t.new_tensor(self.elems(pooled));
        let extra = if self.cpu_op { self.elems(y) } else { 0 };
        (pooled, extra)
    }

    fn conv_block(&mut self, b: &ConvBlock, x: Map) -> Map {
        let mut t = Tally::default();
        let (y, extra) = if b.pool {
            self.conv_bn_relu_pool(&mut t, &b.conv, x, (2, 2, 0))
        } else {
            (self.conv_bn_relu(&mut t, &b.conv, x), 0)
        };
        self.segment(t, x, y, extra)
    }

    fn stem(&mut self, b: &Stem, x: Map) -> Map {
        let mut t = Tally::default();
        let (y, extra) = self.conv_bn_relu_pool(&mut t, &b.conv, x, (3, 2, 1));
        self.segment(t, x, y, extra)
    }

    fn basic_block(&mut self, b: &BasicBlock, x: Map) -> Map {
        let mut t = Tally::default();
        let h = self.conv_bn_relu(&mut t, &b.c1, x);
        let y = conv_out(&b.c2, h);
        t.conv(self.elems(y), b.c2.bias.is_some() && !self.cpu_op);
        if let Some((c, _)) = &b.shortcut {
            let s = conv_out(c, x);
            self.conv_before_bn(&mut t, c, s);
            self.batch_norm(&mut t, s);
        }
        // The second batch norm, the residual sum and the ReLU: one op on the CPU, its output
        // and its weight and bias stacked [2, C] (`ft_kernels::batch_norm_add`); otherwise the
        // batch norm's tensors, the sum and the ReLU.
        if self.cpu_op {
            t.new_tensor(2 * y.c);
        } else {
            self.batch_norm(&mut t, y);
            t.new_tensor(self.elems(y));
        }
        t.new_tensor(self.elems(y));
        self.segment(t, x, y, 0)
    }

    /// A block of `t` from `x` to `y`, with `extra` elements of backward's temporaries. Its
    /// leaf is a copy of `x`, except for the first block, whose input is the episode's images
    /// (no gradient).
    fn segment(&mut self, t: Tally, x: Map, y: Map, extra: u64) -> Map {
        let inputs = if self.segments.is_empty() {
            0
        } else {
            self.elems(x)
        };
        let s = t.segment(self.dtype, self.elems(y), inputs, extra);
        self.segments.push(s);
        y
    }
}

impl FewShotModel {
    /// What one training forward over an episode of `shape` keeps for its backward, in
    /// `dtype`: each backbone block (a checkpoint segment) and the caller's graph (the blocks'
    /// outputs, the head and the loss). The head's attention has one key per query and never
    /// runs the attention kernel; `target` tells whether batch norm is one op.
    pub fn activations(
        &self,
        shape: &EpisodeShape,
        dtype: DType,
        target: Target,
    ) -> ActivationProfile {
        let n = (shape.n_way * (shape.k_shot + shape.n_query)) as u64;
        let mut w = Walk {
            n,
            dtype,
            cpu_op: target.cpu_op(dtype),
            segments: Vec::new(),
        };
        let side = shape.image_size as u64;
        let mut x = Map {
            c: 3,
            h: side,
            w: side,
        };
        for (block, _) in &self.backbone.blocks {
            x = match block {
                Block::Conv(b) => w.conv_block(b, x),
                Block::Stem(b) => w.stem(b, x),
                Block::Basic(b) => w.basic_block(b, x),
            };
        }
        // The caller's graph: every block's output, then the features.
        let mut outer = Tally::default();
        for s in &w.segments {
            outer.new_tensor(s.output / dtype.size_in_bytes() as u64);
        }
        let d = if self.backbone.flatten {
            x.c * x.h * x.w
        } else {
            outer.new_tensor(2 * n * x.c); // sum and mean over the map
            x.c
        };
        let (ways, k, q) = (
            shape.n_way as u64,
            shape.k_shot as u64,
            shape.n_query as u64,
        );
        let queries = ways * q;
        outer.new_tensor(queries * d); // the queries' features gathered
        match &self.fsct {
            None => {
                outer.new_tensor(2 * ways * d); // prototypes: sum and mean
                outer.new_tensor(2 * queries * ways * d); // differences, squared
                outer.new_tensor(2 * queries * ways); // summed, negated
            }
            Some(f) => fsct(&mut outer, f, (ways, k, queries, d), !w.cpu_op),
        }
        // The loss in f32: the scores converted (when they are not f32), log-softmax, the
        // targets' entries, their sum and its negation.
        if dtype != DType::F32 {
            outer.f32_elems += queries * ways;
        }
        outer.f32_elems += queries * ways + queries + 2;
        ActivationProfile {
            outer: outer.bytes(dtype),
            segments: w.segments,
            op_held: 0,
            temporaries: if self
                .backbone
                .blocks
                .iter()
                .any(|(b, _)| matches!(b, Block::Basic(_)))
            {
                if target.cpu_op(dtype) {
                    RESNET_TEMPORARIES
                } else {
                    SEPARATE_RESNET_TEMPORARIES
                }
            } else {
                CONV_TEMPORARIES
            },
        }
    }
}

/// Backward's temporaries through a Conv4/Conv6 block, in thousandths of its graph (measured:
/// `trainer/tests/backward_temporaries.rs`), besides the map of the conv's output size that
/// the batch norm + pooling op forms in its backward (`op_temporaries`, counted apart).
/// Its graph is small (the conv's output and the pooled map) next to the gradients in flight
/// through it: the conv's input and weight gradients (its column buffers are one image's, or a
/// small group's). (Measured again when the pooling op's batch norm backward went in place over
/// its gradient map (one of its two maps, now `op_temporaries`, gone from the peak): -8.6% to
/// +0.5% with 290, 455, 500; when the convolution and the batch norm became one op
/// (`ft_kernels::conv::ConvBatchNorm`), which hands the batch norm's input gradient to the
/// convolution's backward without candle's zeroed slot and sum for it: every row's measured
/// peak lower by 0.8 of a block's graph, 1255, 1245, 1285 before; when the batch norm, ReLU and pooling
/// became one op: the rows within 0.1%; again when a segment's backward began from its
/// output's gradient itself rather than from a product and a sum (the checkpointer's `seed`):
/// `kept` and `recomputed` 2245 and 2280 -> 1245 and 1285, the measured peaks of Conv4's
/// checkpointed rows 18% lower; 2010, 2470, 2490 before, of a graph that kept the normalised
/// map; 2770, 3010, 3030 before the ReLU went inside the batch norm's op; 2420, 2810, 2820
/// before the pool's backward stopped converting to f64.)
const CONV_TEMPORARIES: Temporaries = Temporaries {
    whole: 290,
    kept: 650,
    recomputed: 560,
};

/// Backward's temporaries through a ResNet block, in thousandths of its graph (measured as
/// [`CONV_TEMPORARIES`], -7.4% to +7.5% on its 16 rows). One factor serves the stem (whose
/// graph is its conv's output and the pooled map, with the op's two maps apart) and the basic
/// blocks (two convs, the first batch norm with its ReLU, the shortcut's, and the second batch
/// norm with the residual and the ReLU as one op), whose shares of the peak change with the
/// image size and the episode: it follows neither exactly. Fitted again when the convolutions'
/// weight gradients stopped going through candle's store (`ft_kernels::grad_tap`): ResNet10's
/// rows -1.0% to +3.2%, where the factors before ([`SEPARATE_RESNET_TEMPORARIES`]) overshot
/// `blocks` by up to 21.5% (its deep layers' weights are large next to their maps at 28-36 px);
/// and when segments' backward began from their output's gradient itself: `kept` 2750 -> 1900,
/// `recomputed` 2500 -> 1510.
/// (2860, 4800, 2950 before the blocks'
/// joins went into the batch norm's op; 1435, 2200, 1745 before the stem's batch norm, ReLU,
/// padding and pooling became one op; 1675, 2060, 1895 before the fused ReLUs.)
const RESNET_TEMPORARIES: Temporaries = Temporaries {
    whole: 1400,
    kept: 1900,
    recomputed: 1510,
};

/// [`RESNET_TEMPORARIES`] where the convolutions are candle's (`Target::cpu_op` false: CUDA,
/// and bf16 anywhere): their weights' gradients go through candle's store, a zero-filled slot
/// and an add each, as they all did when these were measured on the CPU (2860 / 5300 / 2950),
/// less what the segments' seeded backward took off `kept` and `recomputed` on the CPU (850
/// and 1000): not measured where these apply.
const SEPARATE_RESNET_TEMPORARIES: Temporaries = Temporaries {
    whole: 2860,
    kept: 4450,
    recomputed: 1950,
};

/// The FSCT head over `queries` query features and `ways` prototypes of `d` dimensions, its
/// linear layers' biases added by a second op when `bias_op`.
fn fsct(t: &mut Tally, f: &Fsct, (ways, k, queries, d): (u64, u64, u64, u64), bias_op: bool) {
    let (heads, dh) = (f.heads as u64, f.dim_head as u64);
    let inner = heads * dh;
    let mlp = f.ffn1.weight.dims()[0] as u64;
    let (qn, hqn) = (queries * ways, heads * queries * ways);
    // Prototypes: the softmax over shots (the transposed [ways, 1, k] weights are
    // contiguous), the weighted support features, their sum.
    t.new_tensor(ways * k + ways * k * d + ways * d);
    // Layer norm and input projection of the prototypes and of the queries.
    for rows in [ways, queries] {
        t.norm(rows * d);
        t.linear(rows, d, inner, false, false);
    }
    // q.k: the prototypes broadcast over queries and the keys, each made contiguous; the dots.
    t.new_tensor(hqn * dh + heads * queries * dh + hqn);
    if f.cosine {
        // |q| and |k| (square, sum, sqrt each), their product, the division.
        t.new_tensor(heads * ways * (dh + 2) + heads * queries * (dh + 2) + 2 * hqn);
    } else {
        t.new_tensor(2 * hqn); // scaled, softmax (over one key)
    }
    // Weights times values (the values made contiguous), heads merged back, the output
    // projection, the residual from the prototypes.
    t.new_tensor(heads * queries * dh + hqn * dh + qn * inner);
    t.linear(qn, inner, d, bias_op, false);
    t.new_tensor(qn * d);
    // Feed-forward with its residual.
    t.norm(qn * d);
    t.linear(qn, d, mlp, bias_op, false);
    t.new_tensor(qn * mlp); // GELU
    t.linear(qn, mlp, d, bias_op, false);
    t.new_tensor(qn * d);
    // Output norm and projection to dim_head.
    t.norm(qn * d);
    t.linear(qn, d, dh, bias_op, false);
    if f.cosine {
        // The input normalised over classes (square; sum, sqrt and + eps per query; divide),
        // the weight-normed vector (square, sum, sqrt, g / norm, v * that), the product,
        // times 2.
        t.new_tensor(2 * qn * dh + 3 * queries * dh + dh + 3 + dh + 2 * qn);
    } else {
        t.linear(qn, dh, 1, bias_op, false);
    }
}
