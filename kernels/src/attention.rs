//! Scaled-dot-product attention with an additive bias or mask.

use candle_core::{Result, Tensor};

use crate::{batched, linear::matmul, softmax::softmax_last_dim};

/// `softmax(q k^T * scale + bias) v` for q [B, H, Lq, D], k [B, H, Lk, D], v [B, H, Lk, Dv];
/// `bias` broadcasts to [B, H, Lq, Lk] (a trainable relative position bias gets its gradient;
/// masks are large negative values). Forms the full score matrix: see the memory-efficient
/// version for long sequences.
pub fn sdpa(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    scores_times_v(q, &Keys::of(q, k)?, v, bias, scale)
}

/// The keys as the score product reads them: as they are, read transposed by the batched op
/// ([`crate::batched`], on the CPU), or transposed for candle's matmul, made contiguous once
/// when several query chunks read them.
enum Keys {
    /// [.., Lk, D], contiguous.
    Rows(Tensor),
    /// [.., D, Lk]: `k^T`.
    Transposed(Tensor),
}

impl Keys {
    fn of(q: &Tensor, k: &Tensor) -> Result<Self> {
        let r = k.rank();
        Ok(if batched::is_one_op(q, k) {
            Keys::Rows(k.contiguous()?)
        } else {
            Keys::Transposed(k.transpose(r.saturating_sub(2), r.saturating_sub(1))?)
        })
    }

    /// Made contiguous, for reading by several chunks.
    fn contiguous(self) -> Result<Self> {
        Ok(match self {
            Keys::Rows(k) => Keys::Rows(k.contiguous()?),
            Keys::Transposed(kt) => Keys::Transposed(kt.contiguous()?),
        })
    }
}

/// `softmax(q k^T * scale + bias) v`: the scores and the output as batched products on the CPU
/// (the scale inside the first), candle's matmul and a multiply elsewhere.
fn scores_times_v(
    q: &Tensor,
    keys: &Keys,
    v: &Tensor,
    bias: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    let s = match keys {
        Keys::Rows(k) => batched::batched_matmul(q, k, false, true, scale)?,
        Keys::Transposed(kt) => {
            let s = matmul(q, kt)?;
            if scale != 1.0 {
                (s * scale)?
            } else {
                s
            }
        }
    };
    let s = match bias {
        Some(b) => s.broadcast_add(b)?,
        None => s,
    };
    let p = softmax_last_dim(&s)?;
    if batched::is_one_op(&p, v) {
        batched::batched_matmul(&p, v, false, false, 1.0)
    } else {
        matmul(&p, v)
    }
}

/// The attention the models call: on CUDA with 64-dim heads (SDXL, CLIP, T5) the
/// memory-efficient kernels of [`crate::cuda`], where a trainable `bias` also gets its gradient;
/// elsewhere [`sdpa`]. Both compute the same function (the CUDA test suite checks the kernels
/// against `sdpa` on the CPU), except that a query row whose every key is masked with -inf gives
/// zeros in the kernels and NaN in `sdpa`: masks here use large finite negatives. The fallback
/// forms at most [`MAX_SCORES`] scores at a time ([`sdpa_query_chunks`]).
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::cuda::fused_attention_supported(q, k, v) {
        return crate::cuda::fused_attention(q, k, v, bias, scale);
    }
    sdpa_query_chunks(q, k, v, bias, scale, MAX_SCORES)
}

/// Score elements (B * H * rows * Lk) one [`sdpa`] call may form in [`attend`]'s fallback: 64 MiB
/// in f32. The SDXL VAE's single 512-dim head over a 128 x 128 latent (1024 px) would otherwise
/// form a 16384 x 16384 matrix, 1 GiB in f32, at every sample decode.
pub const MAX_SCORES: usize = 1 << 24;

/// [`sdpa`] over consecutive chunks of query rows, each forming at most `max_scores` score
/// elements: every row's softmax still sees all its keys, so the result is the same function
/// (gradients included, through `narrow` and `cat`). Without a graph (frozen weights, as in the
/// VAE) each chunk's scores are freed before the next is formed; under autograd they are kept
/// for the backward as the unchunked version keeps its one matrix.
pub fn sdpa_query_chunks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: Option<&Tensor>,
    scale: f64,
    max_scores: usize,
) -> Result<Tensor> {
    if q.rank() != 4 || k.rank() != 4 {
        return sdpa(q, k, v, bias, scale);
    }
    let (b, h, lq, _) = q.dims4()?;
    let lk = k.dim(2)?;
    let rows = (max_scores / (b * h * lk).max(1)).max(1);
    if rows >= lq {
        return sdpa(q, k, v, bias, scale);
    }
    // Keys (transposed where candle's matmul reads them) and values made contiguous once, not
    // once per chunk (under autograd each chunk's copy would be kept for the backward).
    let keys = Keys::of(q, k)?.contiguous()?;
    let v = v.contiguous()?;
    // The bias as rank 4, so that its query dimension (when it has one) can be cut with q's.
    let bias = match bias {
        Some(t) => {
            let mut t = t.clone();
            while t.rank() < 4 {
                t = t.unsqueeze(0)?;
            }
            Some(t)
        }
        None => None,
    };
    let mut outs = Vec::with_capacity(lq.div_ceil(rows));
    for start in (0..lq).step_by(rows) {
        let n = rows.min(lq - start);
        let bc = match &bias {
            Some(t) if t.dim(2)? == lq => Some(t.narrow(2, start, n)?),
            other => other.clone(),
        };
        outs.push(scores_times_v(
            &q.narrow(2, start, n)?,
            &keys,
            &v,
            bc.as_ref(),
            scale,
        )?);
    }
    Tensor::cat(&outs, 2)
}

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape};
use rayon::prelude::*;

/// A constant additive mask with its broadcast strides into [B, H, Lq, Lk].
struct Mask {
    /// f32 even for f64 inputs: masks are 0 or large negatives, and a 1024 x 1024 mask in f64
    /// would be the largest buffer of the op.
    data: Vec<f32>,
    strides: [usize; 4],
}

impl Mask {
    fn new(mask: &Tensor, target: [usize; 4]) -> Result<Self> {
        let mut dims = mask.dims().to_vec();
        if dims.len() > 4 {
            candle_core::bail!("attention mask has rank {}, at most 4", dims.len());
        }
        while dims.len() < 4 {
            dims.insert(0, 1);
        }
        let mut strides = [0usize; 4];
        let mut acc = 1;
        for i in (0..4).rev() {
            if dims[i] != 1 && dims[i] != target[i] {
                candle_core::bail!(
                    "attention mask {:?} does not broadcast to {target:?}",
                    mask.dims()
                );
            }
            strides[i] = if dims[i] == 1 { 0 } else { acc };
            acc *= dims[i];
        }
        let data = mask.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        Ok(Mask { data, strides })
    }

    #[inline]
    fn at(&self, b: usize, h: usize, i: usize, j: usize) -> f64 {
        let s = &self.strides;
        self.data[b * s[0] + h * s[1] + i * s[2] + j * s[3]] as f64
    }
}

/// Memory-efficient attention: see [`sdpa_memory_efficient`].
struct ChunkedAttention {
    scale: f64,
    chunk: usize,
    mask: Option<Arc<Mask>>,
}

struct Dims {
    b: usize,
    h: usize,
    lq: usize,
    lk: usize,
    d: usize,
    dv: usize,
}

fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

impl ChunkedAttention {
    fn score(&self, dm: &Dims, bh: usize, i: usize, j: usize, qi: &[f64], kj: &[f64]) -> f64 {
        let s = self.scale * dot(qi, kj);
        match &self.mask {
            Some(m) => s + m.at(bh / dm.h, bh % dm.h, i, j),
            None => s,
        }
    }

    /// Online softmax over key chunks, one query row at a time: never more than `chunk` scores.
    fn forward(&self, q: &[f64], k: &[f64], v: &[f64], dm: &Dims) -> Vec<f64> {
        let mut out = vec![0f64; dm.b * dm.h * dm.lq * dm.dv];
        out.par_chunks_mut(dm.lq * dm.dv)
            .enumerate()
            .for_each(|(bh, o)| {
                let qb = &q[bh * dm.lq * dm.d..(bh + 1) * dm.lq * dm.d];
                let kb = &k[bh * dm.lk * dm.d..(bh + 1) * dm.lk * dm.d];
                let vb = &v[bh * dm.lk * dm.dv..(bh + 1) * dm.lk * dm.dv];
                let mut scores = vec![0f64; self.chunk];
                for i in 0..dm.lq {
                    let qi = &qb[i * dm.d..(i + 1) * dm.d];
                    let oi = &mut o[i * dm.dv..(i + 1) * dm.dv];
                    let (mut m, mut l) = (f64::NEG_INFINITY, 0f64);
                    for start in (0..dm.lk).step_by(self.chunk) {
                        let end = (start + self.chunk).min(dm.lk);
                        let mut cmax = f64::NEG_INFINITY;
                        for j in start..end {
                            let s = self.score(dm, bh, i, j, qi, &kb[j * dm.d..(j + 1) * dm.d]);
                            scores[j - start] = s;
                            cmax = cmax.max(s);
                        }
                        let m_new = m.max(cmax);
                        if m_new == f64::NEG_INFINITY {
                            continue;
                        }
                        let corr = (m - m_new).exp();
                        l *= corr;
                        oi.iter_mut().for_each(|x| *x *= corr);
                        for j in start..end {
                            let p = (scores[j - start] - m_new).exp();
                            l += p;
                            let vj = &vb[j * dm.dv..(j + 1) * dm.dv];
                            oi.iter_mut().zip(vj).for_each(|(x, y)| *x += p * y);
                        }
                        m = m_new;
                    }
                    if l > 0.0 {
                        oi.iter_mut().for_each(|x| *x /= l);
                    }
                }
            });
        out
    }

    /// FlashAttention-2's backward, one query row at a time: recompute the row's log-sum-exp,
    /// then P = exp(S - LSE), dV += P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ = scale dS K,
    /// dK += scale dS^T Q. Only per-row scalars are stored, never the Lq x Lk matrix.
    #[allow(clippy::type_complexity)]
    fn backward(
        &self,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        o: &[f64],
        go: &[f64],
        dm: &Dims,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let per: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> = (0..dm.b * dm.h)
            .into_par_iter()
            .map(|bh| {
                let qb = &q[bh * dm.lq * dm.d..(bh + 1) * dm.lq * dm.d];
                let kb = &k[bh * dm.lk * dm.d..(bh + 1) * dm.lk * dm.d];
                let vb = &v[bh * dm.lk * dm.dv..(bh + 1) * dm.lk * dm.dv];
                let ob = &o[bh * dm.lq * dm.dv..(bh + 1) * dm.lq * dm.dv];
                let gb = &go[bh * dm.lq * dm.dv..(bh + 1) * dm.lq * dm.dv];
                let mut dq = vec![0f64; dm.lq * dm.d];
                let mut dk = vec![0f64; dm.lk * dm.d];
                let mut dv = vec![0f64; dm.lk * dm.dv];
                for i in 0..dm.lq {
                    let qi = &qb[i * dm.d..(i + 1) * dm.d];
                    let (mut m, mut l) = (f64::NEG_INFINITY, 0f64);
                    for j in 0..dm.lk {
                        let s = self.score(dm, bh, i, j, qi, &kb[j * dm.d..(j + 1) * dm.d]);
                        if s > m {
                            l = l * (m - s).exp() + 1.0;
                            m = s;
                        } else if s > f64::NEG_INFINITY {
                            l += (s - m).exp();
                        }
                    }
                    if l == 0.0 {
                        continue;
                    }
                    let lse = m + l.ln();
                    let goi = &gb[i * dm.dv..(i + 1) * dm.dv];
                    let d_i = dot(goi, &ob[i * dm.dv..(i + 1) * dm.dv]);
                    for j in 0..dm.lk {
                        let kj = &kb[j * dm.d..(j + 1) * dm.d];
                        let p = (self.score(dm, bh, i, j, qi, kj) - lse).exp();
                        let vj = &vb[j * dm.dv..(j + 1) * dm.dv];
                        dv[j * dm.dv..(j + 1) * dm.dv]
                            .iter_mut()
                            .zip(goi)
                            .for_each(|(x, g)| *x += p * g);
                        let ds = p * (dot(goi, vj) - d_i) * self.scale;
                        dq[i * dm.d..(i + 1) * dm.d]
                            .iter_mut()
                            .zip(kj)
                            .for_each(|(x, y)| *x += ds * y);
                        dk[j * dm.d..(j + 1) * dm.d]
                            .iter_mut()
                            .zip(qi)
                            .for_each(|(x, y)| *x += ds * y);
                    }
                }
                (dq, dk, dv)
            })
            .collect();
        let mut dq = Vec::with_capacity(q.len());
        let mut dk = Vec::with_capacity(k.len());
        let mut dv = Vec::with_capacity(v.len());
        for (a, b, c) in per {
            dq.extend(a);
            dk.extend(b);
            dv.extend(c);
        }
        (dq, dk, dv)
    }
}

fn dims_of(q: &[usize], k: &[usize], v: &[usize]) -> Result<Dims> {
    match (q, k, v) {
        ([b, h, lq, d], [b2, h2, lk, d2], [b3, h3, lk2, dv])
            if b == b2 && b == b3 && h == h2 && h == h3 && d == d2 && lk == lk2 =>
        {
            Ok(Dims {
                b: *b,
                h: *h,
                lq: *lq,
                lk: *lk,
                d: *d,
                dv: *dv,
            })
        }
        _ => candle_core::bail!(
            "attention shapes q {q:?}, k {k:?}, v {v:?} do not match [B, H, L, D]"
        ),
    }
}

fn storage_f64(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    Ok(match s {
        CpuStorage::F32(d) => crate::cpu::slice(d, l)?.iter().map(|x| *x as f64).collect(),
        CpuStorage::F64(d) => crate::cpu::slice(d, l)?.to_vec(),
        CpuStorage::F16(d) => crate::cpu::slice(d, l)?
            .iter()
            .map(|x| x.to_f64())
            .collect(),
        CpuStorage::BF16(d) => crate::cpu::slice(d, l)?
            .iter()
            .map(|x| x.to_f64())
            .collect(),
        _ => candle_core::bail!("attention: unsupported dtype"),
    })
}

impl CustomOp3 for ChunkedAttention {
    fn name(&self) -> &'static str {
        "ft-chunked-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dm = dims_of(ql.dims(), kl.dims(), vl.dims())?;
        let o = self.forward(
            &storage_f64(qs, ql)?,
            &storage_f64(ks, kl)?,
            &storage_f64(vs, vl)?,
            &dm,
        );
        let out = match qs {
            CpuStorage::F32(_) => CpuStorage::F32(o.into_iter().map(|x| x as f32).collect()),
            CpuStorage::F64(_) => CpuStorage::F64(o),
            CpuStorage::F16(_) => CpuStorage::F16(o.into_iter().map(half::f16::from_f64).collect()),
            CpuStorage::BF16(_) => {
                CpuStorage::BF16(o.into_iter().map(half::bf16::from_f64).collect())
            }
            _ => candle_core::bail!("attention: unsupported dtype"),
        };
        Ok((out, Shape::from((dm.b, dm.h, dm.lq, dm.dv))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dm = dims_of(q.dims(), k.dims(), v.dims())?;
        let (dq, dk, dv) =
            self.backward(&host(q)?, &host(k)?, &host(v)?, &host(res)?, &host(g)?, &dm);
        let mk = |data: Vec<f64>, like: &Tensor| -> Result<Tensor> {
            Tensor::from_vec(data, like.shape(), like.device())?.to_dtype(like.dtype())
        };
        Ok((Some(mk(dq, q)?), Some(mk(dk, k)?), Some(mk(dv, v)?)))
    }
}

/// The same attention as [`sdpa`], computed without ever forming the Lq x Lk score matrix:
/// the forward runs an online softmax over key chunks of `chunk` keys for one query row at a
/// time, and the backward recomputes the probabilities from the row's log-sum-exp
/// (FlashAttention-2's scheme). Peak memory is O(L * D), not O(L^2).
///
/// `mask` is a constant additive mask broadcastable to [B, H, Lq, Lk] (no gradient flows to it:
/// a trainable bias, like T5's relative position bias, uses [`sdpa`]). A row whose every key is
/// masked with -inf gives zeros (where `sdpa` would give NaN); use a large finite negative to
/// match `sdpa` exactly. On CUDA this is [`crate::cuda::fused_attention`] (64-dim heads; its
/// key tiles are fixed at 64, so `chunk` only applies on the CPU).
pub fn sdpa_memory_efficient(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    chunk: usize,
) -> Result<Tensor> {
    if !q.device().is_cpu() {
        #[cfg(feature = "cuda")]
        if crate::cuda::fused_attention_supported(q, k, v) {
            let mask = mask.map(|m| m.detach());
            return crate::cuda::fused_attention(q, k, v, mask.as_ref(), scale);
        }
        candle_core::bail!(
            "sdpa_memory_efficient runs on the CPU, or on CUDA with 64-dim heads in f32/bf16/f16 \
             (got q {:?} {:?} on {:?})",
            q.dims(),
            q.dtype(),
            q.device()
        );
    }
    let dm = dims_of(q.dims(), k.dims(), v.dims())?;
    let mask = match mask {
        Some(m) => Some(Arc::new(Mask::new(m, [dm.b, dm.h, dm.lq, dm.lk])?)),
        None => None,
    };
    let op = ChunkedAttention {
        scale,
        chunk: chunk.max(1),
        mask,
    };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}
