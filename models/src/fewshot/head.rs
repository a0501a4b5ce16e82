//! FSCT (cosine or softmax attention) and ProtoNet heads over backbone features of an episode.
//!
//! FSCT follows the reference implementation (vinuni-vishc/Few-Shot-Cosine-Transformer,
//! `methods/transformer.py`): prototypes are support features weighted by a learnable softmax
//! over shots; one transformer layer takes the prototypes as queries and each query image's
//! feature as keys and values (8 heads of 64, MLP 512, pre-norm, residuals); the output goes
//! through LayerNorm, Linear(dim, 64) and a cosine classifier (weight-normed linear, scale 2).
//! Cosine attention replaces softmax(q k^T / sqrt(d)) by q.k / (|q| |k|).
//!
//! Two details are kept exactly as the reference computes them: each prototype attends over a
//! single key (its query image), so the softmax variant's attention weight is always 1; and the
//! cosine classifier normalises its input over dimension 1 of a [queries, classes, features]
//! tensor, i.e. across classes.

use candle_core::{DType, Tensor, D};
use ft_kernels::activation::gelu_erf;
use ft_kernels::{linear, softmax};
use ft_params::checkpoint::Checkpointer;
use ft_params::{Init, ParamBuilder};

use super::backbone::Backbone;
use crate::error::{ModelError, Result};
use crate::layers::{Linear as Lin, Norm};

/// Which few-shot method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    FsctCosine,
    FsctSoftmax,
    ProtoNet,
}

impl std::str::FromStr for Method {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "fsct_cosine" | "cosine" => Method::FsctCosine,
            "fsct_softmax" | "softmax" => Method::FsctSoftmax,
            "protonet" => Method::ProtoNet,
            other => {
                return Err(ModelError::Invalid(format!(
                    "unknown method `{other}` (fsct_cosine, fsct_softmax, protonet)"
                )))
            }
        })
    }
}

/// One episode: images [n_way * (k_shot + n_query), 3, S, S], class-major (each class's support
/// images, then its queries).
#[derive(Debug, Clone)]
pub struct Episode {
    pub images: Tensor,
    pub n_way: usize,
    pub k_shot: usize,
    pub n_query: usize,
}

#[derive(Clone)]
pub(crate) struct Fsct {
    pub(crate) cosine: bool,
    pub(crate) heads: usize,
    pub(crate) dim_head: usize,
    proto_weight: Tensor,
    attn_ln: Norm,
    attn_in: Lin,
    attn_out: Lin,
    ffn_ln: Norm,
    pub(crate) ffn1: Lin,
    ffn2: Lin,
    out_ln: Norm,
    out_lin: Lin,
    /// Cosine classifier: WeightNorm(g, v) over Linear(dim_head, 1, bias=False); or plain linear.
    cls_g: Option<Tensor>,
    cls_v: Option<Tensor>,
    cls_lin: Option<Lin>,
}

/// A backbone with a few-shot head.
pub struct FewShotModel {
    pub backbone: Backbone,
    method: Method,
    pub(crate) fsct: Option<Fsct>,
}

impl FewShotModel {
    /// FSCT with the paper's sizes (8 heads of 64, MLP 512) or ProtoNet, for `n_way`-way
    /// `k_shot`-shot episodes (FSCT's prototype weights have that shape).
    pub fn new(
        pb: &ParamBuilder,
        backbone: Backbone,
        method: Method,
        n_way: usize,
        k_shot: usize,
    ) -> Result<Self> {
        let dim = backbone.feat_dim;
        let (heads, dim_head, mlp) = (8, 64, 512);
        let fsct = match method {
            Method::ProtoNet => None,
            _ => {
                let cosine = method == Method::FsctCosine;
                let inner = heads * dim_head;
                let a = pb.pp("ATTN");
                let l2 = pb.pp("linear.2");
                Some(Fsct {
                    cosine,
                    heads,
                    dim_head,
                    proto_weight: pb.get(&[n_way, k_shot, 1], "proto_weight", Init::Ones)?,
                    attn_ln: Norm::layer(&a.pp("input_linear.0"), dim, 1e-5)?,
                    attn_in: Lin::new(&a.pp("input_linear.1"), dim, inner, false)?,
                    attn_out: Lin::new(&a.pp("output_linear"), inner, dim, true)?,
                    ffn_ln: Norm::layer(&pb.pp("FFN.0"), dim, 1e-5)?,
                    ffn1: Lin::new(&pb.pp("FFN.1"), dim, mlp, true)?,
                    ffn2: Lin::new(&pb.pp("FFN.3"), mlp, dim, true)?,
                    out_ln: Norm::layer(&pb.pp("linear.0"), dim, 1e-5)?,
                    out_lin: Lin::new(&pb.pp("linear.1"), dim, dim_head, true)?,
                    // WeightNorm's magnitude g starts at 1 (PyTorch starts it at |v|: a scale only).
                    cls_g: if cosine {
                        Some(l2.pp("L").get(&[1, 1], "weight_g", Init::Ones)?)
                    } else {
                        None
                    },
                    cls_v: if cosine {
                        Some(l2.pp("L").get(
                            &[1, dim_head],
                            "weight_v",
                            Init::Uniform {
                                bound: 1.0 / (dim_head as f64).sqrt(),
                            },
                        )?)
                    } else {
                        None
                    },
                    cls_lin: if cosine {
                        None
                    } else {
                        Some(Lin::new(&l2, dim_head, 1, true)?)
                    },
                })
            }
        };
        Ok(FewShotModel {
            backbone,
            method,
            fsct,
        })
    }

    pub fn method(&self) -> Method {
        self.method
    }

    /// The trainable tensors of each checkpoint segment (the backbone's blocks).
    pub fn segments(&self) -> Vec<Vec<Tensor>> {
        self.backbone.segments()
    }

    /// Class scores [n_way * n_query, n_way] of the episode's queries; the backbone's blocks
    /// run as segments of `ck` (the head is small and runs plain).
    pub fn scores(&self, ep: &Episode, train: bool, ck: &Checkpointer) -> Result<Tensor> {
        let z = self.backbone.forward(&ep.images, train, ck)?;
        let d = z.dim(1)?;
        let z = z.reshape((ep.n_way, ep.k_shot + ep.n_query, d))?;
        let support = z.narrow(1, 0, ep.k_shot)?;
        let query = z
            .narrow(1, ep.k_shot, ep.n_query)?
            .reshape((ep.n_way * ep.n_query, d))?;
        match &self.fsct {
            None => {
                let proto = support.mean(1)?; // [n, d]
                let diff = query.unsqueeze(1)?.broadcast_sub(&proto.unsqueeze(0)?)?;
                Ok(diff.sqr()?.sum(D::Minus1)?.neg()?)
            }
            Some(f) => f.forward(&support, &query),
        }
    }

    /// Cross-entropy summed over the episode's queries, and how many were classified right.
    pub fn summed_loss(
        &self,
        ep: &Episode,
        train: bool,
        ck: &Checkpointer,
    ) -> Result<(Tensor, usize)> {
        loss_of(&self.scores(ep, train, ck)?, ep)
    }

    /// [`Self::summed_loss`] in evaluation, with no graph: the backbone's blocks run under
    /// [`Checkpointer::inference`] (each block's maps freed as the next one runs, and its
    /// batch norm and pooling as one op with no backward, [`super::batch_norm::BnMode::Infer`]);
    /// a graph kept for a backward that never comes would hold every map of the episode, more
    /// than a training step's peak once the training ops keep less. The same values as
    /// `summed_loss(ep, false, _)`, which keeps the graph for a gradient through evaluation.
    pub fn evaluate(&self, ep: &Episode) -> Result<(f32, usize)> {
        let scores = self.scores(ep, false, &Checkpointer::inference())?;
        let (loss, correct) = loss_of(&scores.detach(), ep)?;
        Ok((loss.to_scalar::<f32>()?, correct))
    }
}

/// Cross-entropy summed over the episode's queries from their `scores`, and how many were
/// classified right.
fn loss_of(scores: &Tensor, ep: &Episode) -> Result<(Tensor, usize)> {
    let scores = scores.to_dtype(DType::F32)?;
    let targets: Vec<u32> = (0..ep.n_way)
        .flat_map(|c| std::iter::repeat_n(c as u32, ep.n_query))
        .collect();
    let correct = scores
        .argmax(D::Minus1)?
        .to_vec1::<u32>()?
        .iter()
        .zip(&targets)
        .filter(|(a, b)| a == b)
        .count();
    let t = Tensor::new(targets.as_slice(), scores.device())?;
    let logp = softmax::log_softmax_last_dim(&scores)?;
    let loss = logp.gather(&t.unsqueeze(1)?, 1)?.sum_all()?.neg()?;
    Ok((loss, correct))
}

impl Fsct {
    fn split_heads(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // 'q n (h d) -> h q n d'
        let (q, n, _) = x.dims3()?;
        x.reshape((q, n, self.heads, self.dim_head))?
            .permute((2, 0, 1, 3))
    }

    fn forward(&self, support: &Tensor, query: &Tensor) -> Result<Tensor> {
        let w = softmax::softmax_last_dim(&self.proto_weight.transpose(1, 2)?)?.transpose(1, 2)?; // softmax over shots
        let proto = support.broadcast_mul(&w)?.sum(1)?.unsqueeze(0)?; // [1, n, d]
        let query = query.unsqueeze(1)?; // [Q, 1, d]
        let inp = |t: &Tensor| -> candle_core::Result<Tensor> {
            self.split_heads(&self.attn_in.forward(&self.attn_ln.forward(t)?)?)
        };
        let (fq, fk) = (inp(&proto)?, inp(&query)?); // [h, 1, n, dh], [h, Q, 1, dh]
        let fv = fk.clone();
        let fk_t = fk.transpose(2, 3)?; // [h, Q, dh, 1]
        let dots = linear::matmul(&fq, &fk_t)?; // [h, Q, n, 1]
        let weights = if self.cosine {
            let nq = fq.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?; // [h, 1, n, 1]
            let nk = fk_t.sqr()?.sum_keepdim(2)?.sqrt()?; // [h, Q, 1, 1]
            dots.broadcast_div(&nq.broadcast_mul(&nk)?)?
        } else {
            softmax::softmax_last_dim(&(dots * (self.dim_head as f64).powf(-0.5))?)?
        };
        let out = linear::matmul(&weights, &fv)?; // [h, Q, n, dh]
        let (h, q, n, dh) = out.dims4()?;
        let out = out.permute((1, 2, 0, 3))?.reshape((q, n, h * dh))?;
        let x = proto.broadcast_add(&self.attn_out.forward(&out)?)?; // [Q, n, d]
        let f = self
            .ffn2
            .forward(&gelu_erf(&self.ffn1.forward(&self.ffn_ln.forward(&x)?)?)?)?;
        let x = (x + f)?;
        let y = self.out_lin.forward(&self.out_ln.forward(&x)?)?; // [Q, n, dh]
        let scores = match (&self.cls_g, &self.cls_v, &self.cls_lin) {
            (Some(g), Some(v), _) => {
                // x / (|x| over dim 1 + 1e-5), then the weight-normed linear, times 2.
                let xn = y.broadcast_div(&(y.sqr()?.sum_keepdim(1)?.sqrt()? + 1e-5)?)?;
                let wn = v.broadcast_mul(&g.broadcast_div(&v.sqr()?.sum_keepdim(1)?.sqrt()?)?)?; // [1, dh]
                (linear::linear(&xn, &wn, None)? * 2.0)?
            }
            (_, _, Some(l)) => l.forward(&y)?,
            _ => return Err(ModelError::Invalid("FSCT classifier is missing".into())),
        };
        Ok(scores.squeeze(D::Minus1)?)
    }
}
