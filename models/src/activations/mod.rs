//! Activation bytes from formulas: what a forward keeps for its backward, layer by layer, so
//! that `--plan` (and `--fit`) can count activations for any shape without building the model
//! or running it. Each formula mirrors the ops its model's forward runs and what the kernels of
//! `ft_kernels` keep; `tests/activations.rs` checks every one against [`graph_bytes`] of a real
//! forward (per segment and whole, several shapes, f32 and bf16), so a change to a forward that
//! the formula does not follow fails there.
//!
//! [`graph_bytes`]: ft_params::checkpoint::graph_bytes

mod fewshot;
mod t5;
mod unet;

pub use fewshot::EpisodeShape;
pub use t5::T5Shape;
pub use unet::UNetShape;

use candle_core::DType;
use ft_kernels::attention::MAX_SCORES;
use ft_params::checkpoint::SegmentBytes;

/// Where a forward runs, which decides the attention kernel `ft_kernels::attention::attend`
/// takes: on a CUDA device, heads of 64 dimensions go through the memory-efficient kernels,
/// which keep the output and one f32 log-sum-exp per query row instead of the scores; on the
/// CPU (and for other head sizes) the scores are formed. The CUDA figures follow the kernels'
/// code and have not been measured on a GPU yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Cpu,
    Cuda,
}

impl Target {
    /// The target of a `--device` value (`cpu`, `cuda`, `cuda:N`).
    pub fn of_device(device: &str) -> Self {
        if device == "cpu" {
            Target::Cpu
        } else {
            Target::Cuda
        }
    }

    fn fused_attention(self, head_dim: u64) -> bool {
        self == Target::Cuda && head_dim == 64
    }

    /// Whether a convolution's or a linear layer's bias (when it has one) is a second op after
    /// it (`ft_kernels::linear::is_one_op`).
    pub(crate) fn bias_op(self, dtype: DType) -> bool {
        !self.cpu_op(dtype)
    }

    /// Whether the convolution adds its bias in the same op, batch norm and a linear layer are
    /// one op and attention's products are batched ops (`ft_kernels::conv::bias_in_op`,
    /// `ft_kernels::batch_norm`, `ft_kernels::linear`, `ft_kernels::batched`): the CPU in f32
    /// and f64.
    pub(crate) fn cpu_op(self, dtype: DType) -> bool {
        self == Target::Cpu && matches!(dtype, DType::F32 | DType::F64)
    }
}

/// One attention call: `b` x `heads` x `lq` queries against `lk` keys of `head_dim`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Attention {
    pub b: u64,
    pub heads: u64,
    pub lq: u64,
    pub lk: u64,
    pub head_dim: u64,
    /// Queries / values are head-split views (copied before the product) rather than
    /// contiguous tensors.
    pub q_view: bool,
    pub v_view: bool,
    /// The scores are multiplied by a scale other than 1.
    pub scaled: bool,
    /// Elements of an additive bias tensor (0: none).
    pub bias: u64,
}

impl Attention {
    /// Query rows a score-forming attention takes at once when it may form `max_scores`
    /// scores (`ft_kernels::attention::sdpa_query_chunks`), at most all of them.
    pub fn chunk_rows(&self, max_scores: u64) -> u64 {
        (max_scores / (self.b * self.heads * self.lk).max(1))
            .max(1)
            .min(self.lq)
    }
}

/// Bytes of the tensors a forward creates and its graph keeps, in the activation dtype
/// (`elems`) and in f32 (`f32_elems`: statistics kernels keep in f32), and the elements ops
/// keep beside the graph for their backward (`op_kept`: [`SegmentBytes::op_kept`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Tally {
    pub elems: u64,
    pub f32_elems: u64,
    pub op_kept: u64,
}

impl Tally {
    pub fn bytes(&self, dtype: DType) -> u64 {
        self.elems * dtype.size_in_bytes() as u64 + 4 * self.f32_elems
    }

    /// This tally as a checkpoint segment's: its graph, its `output`, the copies of its
    /// `inputs` (the ones whose gradient is needed) that are its leaves, its backward's
    /// `extra` temporaries ([`SegmentBytes::op_temporaries`]) and what its ops keep beside the
    /// graph, all in elements of `dtype`.
    pub fn segment(&self, dtype: DType, output: u64, inputs: u64, extra: u64) -> SegmentBytes {
        let s = dtype.size_in_bytes() as u64;
        SegmentBytes {
            graph: self.bytes(dtype),
            output: output * s,
            inputs: inputs * s,
            op_temporaries: extra * s,
            op_kept: self.op_kept * s,
        }
    }

    /// A dropout site over `n` elements when dropout is `on`: its output (the mask is not
    /// stored: `ft_kernels::dropout`).
    pub fn dropout(&mut self, on: bool, n: u64) {
        if on {
            self.elems += n;
        }
    }

    /// An elementwise op's output (an activation, a sum, a product, a copy).
    pub fn new_tensor(&mut self, n: u64) {
        self.elems += n;
    }

    /// `ft_kernels::linear::linear` over `rows` rows: the product, the bias sum when the bias
    /// is added by a second op (`bias_op`: there is a bias and the layer is not one op,
    /// [`Target::bias_op`]), and a copy of an input that is a non-contiguous view (`din` wide).
    pub fn linear(&mut self, rows: u64, din: u64, dout: u64, bias_op: bool, view_input: bool) {
        self.elems += rows * dout * (1 + bias_op as u64) + if view_input { rows * din } else { 0 };
    }

    /// `ft_kernels::conv::conv2d` with `out` output elements: the convolution, and the bias sum
    /// when the bias is added by a second op (`bias_op`: there is a bias and the target does
    /// not add it inside the convolution, [`Target::bias_op`]).
    pub fn conv(&mut self, out: u64, bias_op: bool) {
        self.elems += out * (1 + bias_op as u64);
    }

    /// A layer, RMS or group norm with its weight (and bias, and a SiLU after it) over `n`
    /// elements: one op (`ft_kernels::norm`, CPU and CUDA) whose output alone is new.
    pub fn norm(&mut self, n: u64) {
        self.elems += n;
    }

    /// `ft_kernels::attention::attend`.
    pub fn attention(&mut self, a: Attention, target: Target, dtype: DType) {
        self.attention_in_chunks(a, target, dtype, MAX_SCORES as u64)
    }

    /// [`Self::attention`] with the score-forming version taking query rows in chunks of at
    /// most `max_scores` scores (`attend` uses `MAX_SCORES`).
    fn attention_in_chunks(&mut self, a: Attention, target: Target, dtype: DType, max_scores: u64) {
        let inner = a.heads * a.head_dim;
        let (q, kv, out) = (a.b * a.lq * inner, a.b * a.lk * inner, a.b * a.lq * inner);
        if a.q_view {
            self.elems += q;
        }
        if target.fused_attention(a.head_dim) {
            // Keys and values concatenated; the bias in f32 (counted even when it is f32
            // already); the output; the log-sum-exp the op keeps.
            self.elems += 2 * kv + out;
            self.f32_elems += a.bias + a.b * a.heads * a.lq;
            return;
        }
        let scores = a.b * a.heads * a.lq * a.lk;
        // Transposed keys (always a copy; on the CPU in f32/f64 the keys as they are, a copy of
        // their view, `ft_kernels::batched`), values when a view, the scores, their scaled
        // version (not on the CPU in f32/f64: the scale is inside the product) and biased
        // version, the softmax, the output.
        let scale_op = a.scaled && !target.cpu_op(dtype);
        self.elems += kv + if a.v_view { kv } else { 0 };
        self.elems += scores * (2 + scale_op as u64 + (a.bias > 0) as u64) + out;
        // Query rows in chunks of at most MAX_SCORES scores: the chunks' outputs and their
        // concatenation.
        if a.chunk_rows(max_scores) < a.lq {
            self.elems += out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor, Var};
    use ft_kernels::attention::sdpa_query_chunks;
    use ft_params::checkpoint::graph_bytes;

    /// The attention formula against the graph of `sdpa_query_chunks` on head-split views, whole
    /// and in query chunks (the models' tests never form enough scores to chunk), with and
    /// without scale and bias.
    #[test]
    fn attention_formula_equals_the_graph_whole_and_chunked() -> candle_core::Result<()> {
        let (b, h, lq, lk, d) = (2usize, 3usize, 7usize, 5usize, 4usize);
        let dev = Device::Cpu;
        let split = |l: usize| -> candle_core::Result<Tensor> {
            let x = Var::from_tensor(&Tensor::randn(0f32, 1., (b, l, h * d), &dev)?)?;
            x.as_tensor().reshape((b, l, h, d))?.transpose(1, 2)
        };
        let (q, k, v) = (split(lq)?, split(lk)?, split(lk)?);
        let bias = Var::from_tensor(&Tensor::randn(0f32, 1., (1, h, lq, lk), &dev)?)?;
        for max_scores in [1 << 20, b * h * lk * 2, 1] {
            for (scale, with_bias) in [(1.0, true), (0.5, false), (0.5, true)] {
                let bias = with_bias.then(|| bias.as_tensor());
                let y = sdpa_query_chunks(&q, &k, &v, bias, scale, max_scores)?;
                let mut t = Tally::default();
                let a = Attention {
                    b: b as u64,
                    heads: h as u64,
                    lq: lq as u64,
                    lk: lk as u64,
                    head_dim: d as u64,
                    q_view: true,
                    v_view: true,
                    scaled: scale != 1.0,
                    bias: if with_bias { (h * lq * lk) as u64 } else { 0 },
                };
                t.attention_in_chunks(a, Target::Cpu, DType::F32, max_scores as u64);
                assert_eq!(
                    t.bytes(DType::F32),
                    graph_bytes(&y),
                    "max_scores {max_scores}, scale {scale}, bias {with_bias}"
                );
            }
        }
        Ok(())
    }
}
