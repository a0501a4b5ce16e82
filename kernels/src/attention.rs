//! Scaled-dot-product attention with an additive bias or mask.

use candle_core::{Result, Tensor};

use crate::{linear::matmul, softmax::softmax_last_dim};

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
    let s = matmul(q, &k.transpose(2, 3)?)?;
    let s = if scale != 1.0 { (s * scale)? } else { s };
    let s = match bias {
        Some(b) => s.broadcast_add(b)?,
        None => s,
    };
    matmul(&softmax_last_dim(&s)?, v)
}
