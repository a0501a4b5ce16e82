//! T5's activations, mirroring `T5::summed_loss`: encoder and decoder blocks, the shared
//! relative position biases, and the fused head loss.

use candle_core::DType;
use ft_params::checkpoint::{ActivationProfile, SegmentBytes, Temporaries};

use super::{Attention, Tally, Target};
use crate::t5::T5Config;
use ft_kernels::attention::MAX_SCORES;

/// One T5 micro-batch: `batch` examples padded to `source_len` input and `target_len` label
/// tokens.
#[derive(Clone, Copy, Debug)]
pub struct T5Shape {
    pub batch: usize,
    pub source_len: usize,
    pub target_len: usize,
}

struct Walk<'a> {
    cfg: &'a T5Config,
    b: u64,
    dtype: DType,
    target: Target,
    /// Training with dropout: each site keeps its output and its mask.
    dropout: bool,
    outer: Tally,
    segments: Vec<SegmentBytes>,
    /// The block being walked's backward temporaries through its attention scores, in elements.
    score_temporaries: u64,
}

impl Walk<'_> {
    /// Attention of `lq` rows of `x` over `lk` rows, with a bias of `bias` elements, one per
    /// example and score when `per_example` (the encoder's self-attention).
    fn attn(&mut self, t: &mut Tally, lq: u64, lk: u64, bias: u64, per_example: bool) {
        let (b, c) = (self.b, self.cfg);
        let (d, inner) = (c.d_model as u64, (c.num_heads * c.d_kv) as u64);
        t.linear(b * lq, d, inner, false, false);
        t.linear(b * lk, d, inner, false, false);
        t.linear(b * lk, d, inner, false, false);
        let a = Attention {
            b,
            heads: c.num_heads as u64,
            lq,
            lk,
            head_dim: c.d_kv as u64,
            q_view: true,
            v_view: true,
            scaled: false,
            bias,
        };
        t.attention(a, self.target, self.dtype);
        if !self.target.fused_attention(a.head_dim) {
            // The scores' backward runs one query chunk at a time; a bias per example (the
            // encoder's, its padding mask added) has its whole gradient summed over the layers.
            // A decoder block's two attentions run their backward one after the other: the
            // block holds the larger one's temporaries, not both.
            let whole = b * a.heads * lq * lk;
            let chunk = b * a.heads * lk * a.chunk_rows(MAX_SCORES as u64);
            let factors = self.temporaries();
            let mut temporaries = factors.scores * chunk / 1000;
            if per_example {
                temporaries += factors.bias * whole / 1000;
            }
            self.score_temporaries = self.score_temporaries.max(temporaries);
        }
        t.new_tensor(b * lq * inner); // heads merged back
        t.linear(b * lq, inner, d, false, false);
    }

    /// An encoder block over `l` tokens, or a decoder block over `l` tokens reading `cross`
    /// encoder tokens; `bias` is the self-attention bias's element count.
    fn block(&mut self, l: u64, bias: u64, cross: Option<u64>) {
        let (b, d, f) = (self.b, self.cfg.d_model as u64, self.cfg.d_ff as u64);
        let bld = b * l * d;
        let mut t = Tally::default();
        t.norm(bld);
        self.attn(&mut t, l, l, bias, cross.is_none());
        t.dropout(self.dropout, bld);
        t.new_tensor(bld); // residual
        if let Some(ls) = cross {
            t.norm(bld);
            self.attn(&mut t, l, ls, b * ls, false);
            t.dropout(self.dropout, bld);
            t.new_tensor(bld);
        }
        t.norm(bld);
        let gated = self.cfg.activation().map(|(_, g)| g).unwrap_or(false);
        t.linear(b * l, d, f, false, false);
        if gated {
            // `act(wi_0 x) * wi_1 x` as one op keeps no activation output.
            t.linear(b * l, d, f, false, false);
            t.new_tensor(b * l * f); // gated product
        } else {
            t.new_tensor(b * l * f); // activation
        }
        t.dropout(self.dropout, b * l * f);
        t.linear(b * l, f, d, false, false);
        t.dropout(self.dropout, bld);
        t.new_tensor(bld); // residual
                           // Its leaves: the input, the stack's attention bias, and the encoder's output.
        let inputs = bld + bias + cross.map_or(0, |ls| b * ls * d);
        let scores = std::mem::take(&mut self.score_temporaries);
        self.segments
            .push(t.segment(self.dtype, bld, inputs, scores));
        self.outer.new_tensor(bld);
    }

    /// Embedding, position bias and blocks of one stack over `l` tokens, then its final norm.
    fn stack(&mut self, l: u64, layers: usize, cross: Option<u64>) {
        let (b, d, h) = (self.b, self.cfg.d_model as u64, self.cfg.num_heads as u64);
        let outer = &mut self.outer;
        outer.new_tensor(b * l * d); // embedding lookup
        outer.dropout(self.dropout, b * l * d);
        outer.new_tensor(l * l * h); // bucket embeddings
                                     // Plus the key padding mask (encoder, per example) or the causal mask (decoder).
        let bias = if cross.is_some() {
            h * l * l
        } else {
            b * h * l * l
        };
        outer.new_tensor(bias);
        for _ in 0..layers {
            self.block(l, bias, cross);
        }
        self.outer.norm(b * l * d);
        self.outer.dropout(self.dropout, b * l * d);
    }
}

/// T5's backward temporaries: through a block besides its attention scores (`graph`, in
/// thousandths of its graph), through the scores of a composed attention (`scores`, in
/// thousandths of a score tensor per query chunk: the gradients of the probabilities and the
/// scores) and through a bias with one score per example (`bias`, the encoder's with its padding
/// mask added, in thousandths of a score tensor: its gradient, summed over the stack's layers).
#[derive(Clone, Copy)]
struct T5Temporaries {
    graph: Temporaries,
    scores: u64,
    bias: u64,
}

/// Fitted on the CPU in f32 to 160 measured forward-and-backward runs (four T5 sizes, ten
/// shapes from 32 x 16 + 16 to 2 x 2304 + 32 tokens, the last forming its encoder's scores in
/// query chunks, four strategies) through the plan's walk with the gradients formed so far
/// (`ActivationProfile::held_with`), an under-prediction weighing twice: the predicted peaks
/// are 5.0% under to 9.7% over the measured ones. Rerun the fit with
/// `scripts/fit_t5_temporaries.py` (its docstring has the command) whenever the block's ops
/// change (last: the parameters' gradients handed over past candle's store,
/// `ft_kernels::grad_tap`, and the segments' backward seeded with their output's gradient, from
/// 450 / 200 / 350 and bias 1000; before, the linear layers and attention's products as one op
/// each on the CPU, `ft_kernels::linear`, `ft_kernels::batched`, after which [`SEPARATE_OPS`] came up to 9.5%
/// over the main test's rows; before those, the norms as one op). One factor of the graph alone
/// was off by up to 26%: short sequences wanted 1.5 graphs, long ones 3.
const ONE_OP: T5Temporaries = T5Temporaries {
    graph: Temporaries {
        whole: 350,
        kept: 100,
        recomputed: 250,
    },
    scores: 8500,
    bias: 1500,
};

/// Where the linear layers and attention's products are candle's ops (`Target::cpu_op` false:
/// bf16, CUDA): the same fit while the CPU ran them too (4.7% under to 9.3% over). On a GPU the
/// attention of 64-wide heads forms no scores, and the backward's temporaries there have not
/// been measured.
const SEPARATE_OPS: T5Temporaries = T5Temporaries {
    graph: Temporaries {
        whole: 600,
        kept: 300,
        recomputed: 450,
    },
    scores: 7500,
    bias: 1500,
};

impl Walk<'_> {
    /// The factors for this walk's target and dtype.
    fn temporaries(&self) -> T5Temporaries {
        if self.target.cpu_op(self.dtype) {
            ONE_OP
        } else {
            SEPARATE_OPS
        }
    }
}

impl T5Config {
    /// What one forward of `summed_loss` at `shape` keeps for its backward, in `dtype`, with
    /// attention as it runs on `target` and, when `dropout`, this config's dropout on: the
    /// caller's graph, each block (a checkpoint segment) in forward order, and what ops keep
    /// outside the graph: the fused head loss's gradients (of the hidden states, and of the
    /// head in f32). Dropout keeps no mask (`ft_kernels::dropout`).
    pub fn activations(
        &self,
        shape: &T5Shape,
        dtype: DType,
        target: Target,
        dropout: bool,
    ) -> ActivationProfile {
        let (b, d) = (shape.batch as u64, self.d_model as u64);
        let (ls, lt) = (shape.source_len as u64, shape.target_len as u64);
        let mut w = Walk {
            cfg: self,
            b,
            dtype,
            target,
            dropout: dropout && self.dropout_rate > 0.0,
            outer: Tally::default(),
            segments: Vec::new(),
            score_temporaries: 0,
        };
        w.stack(ls, self.num_layers, None);
        w.stack(lt, self.decoder_layers(), Some(ls));
        if self.tie_word_embeddings {
            w.outer.new_tensor(b * lt * d); // hidden states scaled by d_model^-0.5
        }
        w.outer.f32_elems += 1; // the loss
        let s = dtype.size_in_bytes() as u64;
        let temporaries = w.temporaries().graph;
        ActivationProfile {
            outer: w.outer.bytes(dtype),
            segments: w.segments,
            op_held: b * lt * d * s + 4 * self.vocab_size as u64 * d,
            temporaries,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decoder block runs its self- and cross-attention's backward one after the other: with
    /// both of one size (target as long as source) it holds one attention's score temporaries,
    /// not two; an encoder block adds its per-example bias's.
    #[test]
    fn a_block_holds_its_larger_attentions_score_temporaries() {
        let cfg = T5Config::tiny(32);
        let (b, l, h) = (2u64, 16u64, cfg.num_heads as u64);
        let shape = T5Shape {
            batch: b as usize,
            source_len: l as usize,
            target_len: l as usize,
        };
        let p = cfg.activations(&shape, DType::F32, Target::Cpu, false);
        // One attention's scores (no chunks at this size), in f32 bytes.
        let scores = 4 * b * h * l * l;
        let decoder = &p.segments[cfg.num_layers];
        assert_eq!(decoder.op_temporaries, ONE_OP.scores * scores / 1000);
        let encoder = &p.segments[0];
        assert_eq!(
            encoder.op_temporaries,
            (ONE_OP.scores + ONE_OP.bias) * scores / 1000
        );
    }
}
