//! The T5 encoder-decoder: full-sequence teacher-forced decoder, padding and causal masks,
//! relative position bias shared by the layers of a stack, RMS norm, dropout, tied or untied head.

use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Tensor, Var, D};
use ft_kernels::activation::{self, Activation};
use ft_kernels::cross_entropy::linear_cross_entropy;
use ft_kernels::gated::gated;
use ft_kernels::{attention, linear, norm, softmax};
use ft_params::checkpoint::{Checkpointer, SegmentFn};
use ft_params::{Init, ParamBuilder};

use super::config::{FfAct, T5Config};
use super::position::bucket_grid;
use crate::dropout::DropoutCtx;
use crate::error::{ModelError, Result};

/// Value added to masked attention scores (transformers uses `finfo(dtype).min`; a finite value
/// keeps a fully masked row finite).
const MASK: f64 = -1e9;

/// One padded batch: source ids and mask, target labels (-100 where padding).
#[derive(Debug, Clone)]
pub struct T5Batch {
    /// [B, Ls] u32.
    pub input_ids: Tensor,
    /// [B, Ls] f32, 1 for tokens, 0 for padding.
    pub attention_mask: Tensor,
    /// [B, Lt] i64 labels, -100 where the target is padding.
    pub labels: Tensor,
    /// Number of label tokens (not -100).
    pub label_tokens: usize,
}

impl T5Batch {
    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.input_ids.dims().first().copied().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `n` samples and the rest, each padded as the whole was: every sample computes
    /// what it computed in the whole (with `DropoutCtx::from_sample`, its masks too).
    pub fn split_at(&self, n: usize) -> candle_core::Result<(T5Batch, T5Batch)> {
        let b = self.len();
        if n == 0 || n >= b {
            candle_core::bail!("cannot split a batch of {b} at {n}");
        }
        let part = |start: usize, len: usize| -> candle_core::Result<T5Batch> {
            let labels = self.labels.narrow(0, start, len)?;
            let label_tokens = labels
                .ge(0i64)?
                .to_dtype(candle_core::DType::U32)?
                .sum_all()?
                .to_scalar::<u32>()? as usize;
            Ok(T5Batch {
                input_ids: self.input_ids.narrow(0, start, len)?,
                attention_mask: self.attention_mask.narrow(0, start, len)?,
                labels,
                label_tokens,
            })
        };
        Ok((part(0, n)?, part(n, b - n)?))
    }
}

/// transformers' `_shift_right`: decoder inputs are the labels moved right by one, starting
/// with `decoder_start`, with -100 replaced by `pad`.
pub fn shift_right(labels: &[Vec<i64>], decoder_start: u32, pad: u32) -> Vec<Vec<u32>> {
    labels
        .iter()
        .map(|row| {
            let mut out = Vec::with_capacity(row.len());
            out.push(decoder_start);
            for &l in row.iter().take(row.len().saturating_sub(1)) {
                out.push(if l < 0 { pad } else { l as u32 });
            }
            out
        })
        .collect()
}

#[derive(Clone)]
struct Attention {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    heads: usize,
    d_kv: usize,
}

impl Attention {
    fn new(pb: &ParamBuilder, cfg: &T5Config) -> Result<Self> {
        let inner = cfg.num_heads * cfg.d_kv;
        let dm = cfg.d_model as f64;
        Ok(Attention {
            q: pb.get(
                &[inner, cfg.d_model],
                "q.weight",
                Init::Normal {
                    std: (dm * cfg.d_kv as f64).powf(-0.5),
                },
            )?,
            k: pb.get(
                &[inner, cfg.d_model],
                "k.weight",
                Init::Normal { std: dm.powf(-0.5) },
            )?,
            v: pb.get(
                &[inner, cfg.d_model],
                "v.weight",
                Init::Normal { std: dm.powf(-0.5) },
            )?,
            o: pb.get(
                &[cfg.d_model, inner],
                "o.weight",
                Init::Normal {
                    std: (inner as f64).powf(-0.5),
                },
            )?,
            heads: cfg.num_heads,
            d_kv: cfg.d_kv,
        })
    }

    fn split(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, l, _) = x.dims3()?;
        x.reshape((b, l, self.heads, self.d_kv))?.transpose(1, 2)
    }

    /// Unscaled dot-product attention (T5 folds the 1/sqrt(d) into the initialisation) with an
    /// additive `bias` broadcastable to [B, H, Lq, Lk].
    fn forward(&self, x: &Tensor, kv: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
        let q = self.split(&linear::linear(x, &self.q, None)?)?;
        let k = self.split(&linear::linear(kv, &self.k, None)?)?;
        let v = self.split(&linear::linear(kv, &self.v, None)?)?;
        let a = attention::attend(&q, &k, &v, Some(bias), 1.0)?;
        let (b, _, l, _) = a.dims4()?;
        let a = a.transpose(1, 2)?.reshape((b, l, self.heads * self.d_kv))?;
        linear::linear(&a, &self.o, None)
    }

    fn tensors(&self) -> [&Tensor; 4] {
        [&self.q, &self.k, &self.v, &self.o]
    }
}

#[derive(Clone)]
struct FeedForward {
    wi: Vec<Tensor>,
    wo: Tensor,
    act: FfAct,
}

impl FeedForward {
    fn new(pb: &ParamBuilder, cfg: &T5Config, act: FfAct, gated: bool) -> Result<Self> {
        let std_in = Init::Normal {
            std: (cfg.d_model as f64).powf(-0.5),
        };
        let wi = if gated {
            vec![
                pb.get(&[cfg.d_ff, cfg.d_model], "wi_0.weight", std_in)?,
                pb.get(&[cfg.d_ff, cfg.d_model], "wi_1.weight", std_in)?,
            ]
        } else {
            vec![pb.get(&[cfg.d_ff, cfg.d_model], "wi.weight", std_in)?]
        };
        let wo = pb.get(
            &[cfg.d_model, cfg.d_ff],
            "wo.weight",
            Init::Normal {
                std: (cfg.d_ff as f64).powf(-0.5),
            },
        )?;
        Ok(FeedForward { wi, wo, act })
    }

    fn forward(&self, x: &Tensor, drop: &DropoutCtx, site: &str) -> candle_core::Result<Tensor> {
        let act = match self.act {
            FfAct::Relu => Activation::Relu,
            FfAct::GeluNew => Activation::GeluTanh,
            FfAct::Silu => Activation::Silu,
        };
        let h = linear::linear(x, &self.wi[0], None)?;
        // Gated (v1.1, FLAN): one op, which keeps no activation output for the product's
        // backward (`ft_kernels::gated`).
        let h = match self.wi.get(1) {
            Some(w1) => gated(&h, &linear::linear(x, w1, None)?, act)?,
            None => activation::activate(&h, act)?,
        };
        let h = drop.apply(&h, site)?;
        linear::linear(&h, &self.wo, None)
    }
}

/// One block: self-attention, cross-attention (decoder only), feed-forward, each pre-normed with
/// a residual connection.
#[derive(Clone)]
struct Block {
    name: String,
    self_attn: Attention,
    self_norm: Tensor,
    cross: Option<(Attention, Tensor)>,
    ff: FeedForward,
    ff_norm: Tensor,
    eps: f64,
}

impl Block {
    fn new(
        pb: &ParamBuilder,
        cfg: &T5Config,
        decoder: bool,
        act: FfAct,
        gated: bool,
    ) -> Result<Self> {
        let l0 = pb.pp("layer.0");
        let self_attn = Attention::new(&l0.pp("SelfAttention"), cfg)?;
        let self_norm = l0.get(&[cfg.d_model], "layer_norm.weight", Init::Ones)?;
        let (cross, ff_layer) = if decoder {
            let l1 = pb.pp("layer.1");
            let attn = Attention::new(&l1.pp("EncDecAttention"), cfg)?;
            let n = l1.get(&[cfg.d_model], "layer_norm.weight", Init::Ones)?;
            (Some((attn, n)), pb.pp("layer.2"))
        } else {
            (None, pb.pp("layer.1"))
        };
        let ff = FeedForward::new(&ff_layer.pp("DenseReluDense"), cfg, act, gated)?;
        let ff_norm = ff_layer.get(&[cfg.d_model], "layer_norm.weight", Init::Ones)?;
        Ok(Block {
            name: String::new(),
            self_attn,
            self_norm,
            cross,
            ff,
            ff_norm,
            eps: cfg.layer_norm_epsilon,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        self_bias: &Tensor,
        cross: Option<(&Tensor, &Tensor)>,
        drop: &DropoutCtx,
    ) -> candle_core::Result<Tensor> {
        let n = norm::rms_norm(x, Some(&self.self_norm), self.eps)?;
        let a = self.self_attn.forward(&n, &n, self_bias)?;
        let mut x = (x + drop.apply(&a, &format!("{}.self", self.name))?)?;
        if let (Some((attn, cn)), Some((enc, mask))) = (&self.cross, cross) {
            let n = norm::rms_norm(&x, Some(cn), self.eps)?;
            let a = attn.forward(&n, enc, mask)?;
            x = (x + drop.apply(&a, &format!("{}.cross", self.name))?)?;
        }
        let n = norm::rms_norm(&x, Some(&self.ff_norm), self.eps)?;
        let f = self
            .ff
            .forward(&n, drop, &format!("{}.ff.inner", self.name))?;
        x + drop.apply(&f, &format!("{}.ff", self.name))?
    }

    /// The tensors its checkpoint segment uses.
    fn segment_tensors(&self) -> Vec<Tensor> {
        let mut ts: Vec<&Tensor> = self.self_attn.tensors().to_vec();
        ts.push(&self.self_norm);
        if let Some((a, n)) = &self.cross {
            ts.extend(a.tensors());
            ts.push(n);
        }
        ts.extend(self.ff.wi.iter());
        ts.push(&self.ff.wo);
        ts.push(&self.ff_norm);
        ts.into_iter().cloned().collect()
    }

    /// Its trainable tensors, as the checkpoint segment takes them.
    fn vars(&self) -> candle_core::Result<Vec<Var>> {
        self.segment_tensors()
            .iter()
            .filter(|t| t.is_variable())
            .map(Var::from_tensor)
            .collect()
    }
}

struct Stack {
    blocks: Vec<(Block, Vec<Var>)>,
    rel_bias: Tensor,
    final_norm: Tensor,
    decoder: bool,
    buckets: usize,
    max_distance: usize,
    eps: f64,
    name: &'static str,
}

impl Stack {
    fn new(
        pb: &ParamBuilder,
        cfg: &T5Config,
        decoder: bool,
        act: FfAct,
        gated: bool,
    ) -> Result<Self> {
        let name = if decoder { "decoder" } else { "encoder" };
        let pb = pb.pp(name);
        let n_layers = if decoder {
            cfg.decoder_layers()
        } else {
            cfg.num_layers
        };
        let rel_bias = pb.pp("block.0.layer.0.SelfAttention").get(
            &[cfg.relative_attention_num_buckets, cfg.num_heads],
            "relative_attention_bias.weight",
            Init::Normal {
                std: (cfg.d_model as f64).powf(-0.5),
            },
        )?;
        let mut blocks = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let mut b = Block::new(&pb.pp(format!("block.{i}")), cfg, decoder, act, gated)?;
            b.name = format!("{name}.block.{i}");
            let vars = b.vars()?;
            blocks.push((b, vars));
        }
        let final_norm = pb.get(&[cfg.d_model], "final_layer_norm.weight", Init::Ones)?;
        Ok(Stack {
            blocks,
            rel_bias,
            final_norm,
            decoder,
            buckets: cfg.relative_attention_num_buckets,
            max_distance: cfg.relative_attention_max_distance,
            eps: cfg.layer_norm_epsilon,
            name,
        })
    }

    /// [1, H, Lq, Lk] relative position bias (bidirectional in the encoder, causal buckets in
    /// the decoder), from the first block's embedding, shared by every block of the stack.
    fn position_bias(&self, q_len: usize, k_len: usize) -> candle_core::Result<Tensor> {
        let ids = bucket_grid(q_len, k_len, !self.decoder, self.buckets, self.max_distance);
        let ids = Tensor::from_vec(ids, q_len * k_len, self.rel_bias.device())?;
        let heads = self.rel_bias.dim(1)?;
        self.rel_bias
            .index_select(&ids, 0)?
            .reshape((q_len, k_len, heads))?
            .permute((2, 0, 1))?
            .unsqueeze(0)
    }

    fn forward(
        &self,
        x: Tensor,
        bias: Tensor,
        cross: Option<(&Tensor, &Tensor)>,
        drop: &DropoutCtx,
        ck: &Checkpointer,
    ) -> Result<Tensor> {
        let mut x = x;
        for (block, vars) in &self.blocks {
            let b = block.clone();
            let d = *drop;
            x = match cross {
                None => {
                    let f: SegmentFn =
                        Arc::new(move |xs: &[Tensor]| b.forward(&xs[0], &xs[1], None, &d));
                    ck.run(f, &[&x, &bias], vars)?
                }
                Some((enc, mask)) => {
                    let mask = mask.clone();
                    let f: SegmentFn = Arc::new(move |xs: &[Tensor]| {
                        b.forward(&xs[0], &xs[2], Some((&xs[1], &mask)), &d)
                    });
                    ck.run(f, &[&x, enc, &bias], vars)?
                }
            };
        }
        let x = norm::rms_norm(&x, Some(&self.final_norm), self.eps)?;
        Ok(drop.apply(&x, &format!("{}.final", self.name))?)
    }
}

/// T5ForConditionalGeneration.
pub struct T5 {
    cfg: T5Config,
    shared: Tensor,
    encoder: Stack,
    decoder: Stack,
    lm_head: Option<Tensor>,
}

impl T5 {
    /// Builds the model from `pb` (a checkpoint source or seeded initialisation).
    pub fn new(pb: &ParamBuilder, cfg: &T5Config) -> Result<Self> {
        cfg.validate().map_err(ModelError::Invalid)?;
        let (act, gated) = cfg.activation().map_err(ModelError::Invalid)?;
        let shared = pb.get(
            &[cfg.vocab_size, cfg.d_model],
            "shared.weight",
            Init::Normal { std: 1.0 },
        )?;
        let encoder = Stack::new(pb, cfg, false, act, gated)?;
        let decoder = Stack::new(pb, cfg, true, act, gated)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(pb.get(
                &[cfg.vocab_size, cfg.d_model],
                "lm_head.weight",
                Init::Normal { std: 1.0 },
            )?)
        };
        Ok(T5 {
            cfg: cfg.clone(),
            shared,
            encoder,
            decoder,
            lm_head,
        })
    }

    pub fn config(&self) -> &T5Config {
        &self.cfg
    }

    /// The tensors of each checkpoint segment (every encoder and decoder block): what a fused
    /// backward pass holds gradients for at once is one of these and everything outside them
    /// (`ParamStore::segments`).
    pub fn segments(&self) -> Vec<Vec<Tensor>> {
        let blocks = self.encoder.blocks.iter().chain(&self.decoder.blocks);
        blocks.map(|(b, _)| b.segment_tensors()).collect()
    }

    pub fn device(&self) -> &Device {
        self.shared.device()
    }

    pub fn dtype(&self) -> DType {
        self.shared.dtype()
    }

    fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, l) = ids.dims2()?;
        self.shared
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, l, self.cfg.d_model))
    }

    /// Additive [B, 1, 1, L] mask from a [B, L] 0/1 mask.
    fn key_mask(&self, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, l) = mask.dims2()?;
        // 0 where attended, MASK (large negative) where padding.
        ((mask.to_dtype(DType::F32)? - 1.0)? * (-MASK))?
            .to_dtype(self.dtype())?
            .reshape((b, 1, 1, l))
    }

    /// Encoder hidden states [B, Ls, D].
    pub fn encode(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        drop: &DropoutCtx,
        ck: &Checkpointer,
    ) -> Result<Tensor> {
        let (_, ls) = input_ids.dims2()?;
        let x = drop.apply(&self.embed(input_ids)?, "encoder.embed")?;
        let bias = self
            .encoder
            .position_bias(ls, ls)?
            .broadcast_add(&self.key_mask(attention_mask)?)?;
        self.encoder.forward(x, bias, None, drop, ck)
    }

    /// Decoder hidden states [B, Lt, D] for teacher-forced `decoder_ids`.
    pub fn decode(
        &self,
        decoder_ids: &Tensor,
        encoder_out: &Tensor,
        attention_mask: &Tensor,
        drop: &DropoutCtx,
        ck: &Checkpointer,
    ) -> Result<Tensor> {
        let (_, lt) = decoder_ids.dims2()?;
        let x = drop.apply(&self.embed(decoder_ids)?, "decoder.embed")?;
        let causal: Vec<f32> = (0..lt)
            .flat_map(|q| (0..lt).map(move |k| if k > q { MASK as f32 } else { 0.0 }))
            .collect();
        let causal =
            Tensor::from_vec(causal, (1, 1, lt, lt), self.device())?.to_dtype(self.dtype())?;
        let bias = self.decoder.position_bias(lt, lt)?.broadcast_add(&causal)?;
        let cross_mask = self.key_mask(attention_mask)?;
        self.decoder
            .forward(x, bias, Some((encoder_out, &cross_mask)), drop, ck)
    }

    /// Vocabulary logits [B, Lt, V] from decoder hidden states (a tied head scales by
    /// d_model^-0.5, as transformers does).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(match &self.lm_head {
            Some(w) => linear::linear(hidden, w, None)?,
            None => {
                let h = (hidden * (self.cfg.d_model as f64).powf(-0.5))?;
                linear::linear(&h, &self.shared, None)?
            }
        })
    }

    /// Decoder hidden states [B, Lt, D] for a batch, teacher-forced on its shifted labels.
    pub fn hidden(&self, batch: &T5Batch, drop: &DropoutCtx, ck: &Checkpointer) -> Result<Tensor> {
        let enc = self.encode(&batch.input_ids, &batch.attention_mask, drop, ck)?;
        let labels = batch.labels.to_vec2::<i64>()?;
        let dec_ids = shift_right(&labels, self.cfg.decoder_start(), self.cfg.pad_token_id);
        let (b, lt) = (dec_ids.len(), dec_ids.first().map(|r| r.len()).unwrap_or(0));
        let dec_ids = Tensor::from_vec(dec_ids.concat(), (b, lt), self.device())?;
        self.decode(&dec_ids, &enc, &batch.attention_mask, drop, ck)
    }

    /// Teacher-forced logits for a batch.
    pub fn forward(&self, batch: &T5Batch, drop: &DropoutCtx, ck: &Checkpointer) -> Result<Tensor> {
        self.logits(&self.hidden(batch, drop, ck)?)
    }

    /// Cross-entropy summed over label tokens (in f32), for accumulation over micro-batches.
    ///
    /// The head and the loss are one op ([`linear_cross_entropy`]) that never holds the whole
    /// [B, Lt, vocab] logits: the same value and gradients as `summed_cross_entropy(forward)`
    /// up to summation order, without the vocabulary-sized tensors that made the head's backward
    /// the step's memory peak.
    pub fn summed_loss(
        &self,
        batch: &T5Batch,
        drop: &DropoutCtx,
        ck: &Checkpointer,
    ) -> Result<Tensor> {
        let hidden = self.hidden(batch, drop, ck)?;
        self.head_loss(&hidden, &batch.labels, false)
    }

    /// [`Self::summed_loss`] for evaluation: nothing is kept for a backward (each block's graph
    /// freed as it returns, [`Checkpointer::inference`]; the head computes no gradients).
    pub fn eval_summed_loss(&self, batch: &T5Batch) -> Result<Tensor> {
        let ck = Checkpointer::inference();
        let hidden = self.hidden(batch, &DropoutCtx::eval(), &ck)?.detach();
        self.head_loss(&hidden, &batch.labels, true)
    }

    fn head_loss(&self, hidden: &Tensor, labels: &Tensor, frozen: bool) -> Result<Tensor> {
        let (h, w) = match &self.lm_head {
            Some(w) => (hidden.clone(), w.clone()),
            None => (
                (hidden * (self.cfg.d_model as f64).powf(-0.5))?,
                self.shared.clone(),
            ),
        };
        let w = if frozen { w.detach() } else { w };
        Ok(linear_cross_entropy(&h, &w, labels)?)
    }

    /// Greedy generation of up to `max_len` tokens (stops at EOS), without a cache: each step
    /// re-runs the decoder on the prefix, which is exact and enough for evaluation.
    pub fn generate_greedy(
        &self,
        input_ids: &Tensor,
        attention_mask: &Tensor,
        max_len: usize,
    ) -> Result<Vec<Vec<u32>>> {
        let drop = DropoutCtx::eval();
        let ck = Checkpointer::inference();
        let enc = self.encode(input_ids, attention_mask, &drop, &ck)?.detach();
        let b = input_ids.dim(0)?;
        let mut seqs: Vec<Vec<u32>> = vec![vec![self.cfg.decoder_start()]; b];
        let mut done = vec![false; b];
        for _ in 0..max_len {
            let lt = seqs[0].len();
            let ids = Tensor::from_vec(seqs.concat(), (b, lt), self.device())?;
            let h = self.decode(&ids, &enc, attention_mask, &drop, &ck)?;
            let last = self.logits(&h.i((.., lt - 1..lt, ..))?)?.squeeze(1)?;
            let next = last
                .to_dtype(DType::F32)?
                .argmax(D::Minus1)?
                .to_vec1::<u32>()?;
            for (i, s) in seqs.iter_mut().enumerate() {
                let tok = if done[i] {
                    self.cfg.pad_token_id
                } else {
                    next[i]
                };
                if tok == self.cfg.eos_token_id {
                    done[i] = true;
                }
                s.push(tok);
            }
            if done.iter().all(|d| *d) {
                break;
            }
        }
        Ok(seqs
            .into_iter()
            .map(|s| {
                s.into_iter()
                    .skip(1)
                    .take_while(|&t| t != self.cfg.eos_token_id)
                    .collect()
            })
            .collect())
    }
}

/// Sum over positions whose label is not negative of `-log softmax(logits)[label]`, in f32.
pub fn summed_cross_entropy(logits: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
    let v = logits.dim(D::Minus1)?;
    let logits = logits.to_dtype(DType::F32)?.reshape(((), v))?;
    let labels = labels.flatten_all()?.to_dtype(DType::I64)?;
    let valid = labels.ge(0i64)?;
    let safe = valid
        .where_cond(&labels, &labels.zeros_like()?)?
        .to_dtype(DType::U32)?;
    let logp = softmax::log_softmax_last_dim(&logits)?;
    let picked = logp.gather(&safe.unsqueeze(1)?, 1)?.squeeze(1)?;
    let mask = valid.to_dtype(DType::F32)?;
    (picked * mask)?.sum_all()?.neg()
}
