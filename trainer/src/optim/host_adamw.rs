//! AdamW on the CPU in one threaded pass per parameter.
//!
//! With the optimizer state offloaded (`StatePlacement::Host`) every step of a 2.6-2.9B model
//! runs here: op by op (about fifteen single-threaded passes over fp32 tensors) that is about
//! 40 ns per parameter on the 2-core development VM, near two minutes per step at FLAN-T5-XL
//! size. This pass reads the master, both moments and the gradient once, writes them once, and
//! splits the work over the machine's cores, as DeepSpeed's CPU Adam does. Each element is
//! computed with exactly the f32 operations, in the same order, that the op-by-op update
//! (`AdamW::step`'s reference path, i.e. candle's `affine` and binary kernels) performs, so the
//! two give identical bits (tested in `tests/host_ops.rs`).

use candle_core::Tensor;

use ft_kernels::host::{with_f32, CHUNK};

/// The per-step constants of the update, as the op-by-op path turns them into f32.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostStep {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub lr: f64,
    pub weight_decay: f64,
    pub step_size: f64,
    pub bc2_sqrt: f64,
    /// Factor on every gradient (a clipping coefficient; 1 for none), applied as candle's
    /// `affine` applies it, so that the result equals clipping a copy first.
    pub grad_mul: f64,
}

/// One AdamW update of `p` with gradient `g` and moments `m`, `v` (`None` at the first step),
/// all contiguous f32 CPU tensors of one length. Returns the new parameter and moments, or
/// `None` when a tensor is not of that kind (the caller then takes the op-by-op path).
pub(crate) fn update(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    s: &HostStep,
) -> Option<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    with_f32(p, |p| {
        with_f32(g, |g| {
            let go = |m: Option<&[f32]>, v: Option<&[f32]>| run(p, g, m, v, s);
            match (m, v) {
                (None, None) => Some(go(None, None)),
                (Some(m), Some(v)) => {
                    with_f32(m, |m| with_f32(v, |v| go(Some(m), Some(v)))).flatten()
                }
                _ => None,
            }
        })
    })
    .flatten()
    .flatten()
    .filter(|(np, _, _)| np.len() == p.elem_count())
}

fn run(
    p: &[f32],
    g: &[f32],
    m: Option<&[f32]>,
    v: Option<&[f32]>,
    s: &HostStep,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    use rayon::prelude::*;
    let n = p.len();
    if g.len() != n || m.is_some_and(|m| m.len() != n) || v.is_some_and(|v| v.len() != n) {
        return (Vec::new(), Vec::new(), Vec::new());
    }
    let (mut np, mut nm, mut nv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    let c = CHUNK;
    np.par_chunks_mut(c)
        .zip(nm.par_chunks_mut(c))
        .zip(nv.par_chunks_mut(c))
        .enumerate()
        .for_each(|(i, ((op, om), ov))| {
            let r = i * c..i * c + op.len();
            let (mi, vi) = (m.map(|m| &m[r.clone()]), v.map(|v| &v[r.clone()]));
            chunk_update(&p[r.clone()], &g[r], mi, vi, op, om, ov, s);
        });
    (np, nm, nv)
}

/// The update of one chunk, element by element with [`element`].
#[allow(clippy::too_many_arguments)]
fn chunk_update(
    p: &[f32],
    g: &[f32],
    m: Option<&[f32]>,
    v: Option<&[f32]>,
    out_p: &mut [f32],
    out_m: &mut [f32],
    out_v: &mut [f32],
    s: &HostStep,
) {
    for i in 0..p.len() {
        (out_p[i], out_m[i], out_v[i]) = element(p[i], g[i], m.map(|m| m[i]), v.map(|v| v[i]), s);
    }
}

/// One element's update (new weight, first and second moment), operation for operation as the
/// op-by-op path: `x * mul + add` is candle's `affine` (the `+ 0.0` included: it turns -0.0
/// into 0.0 there too). `None` moments are the first step's.
pub(crate) fn element(
    p: f32,
    g: f32,
    m: Option<f32>,
    v: Option<f32>,
    s: &HostStep,
) -> (f32, f32, f32) {
    let affine = |x: f32, mul: f64, add: f64| x * mul as f32 + add as f32;
    let g = if s.grad_mul != 1.0 {
        affine(g, s.grad_mul, 0.0)
    } else {
        g
    };
    let (b1, b2) = (s.beta1, s.beta2);
    let m = match m {
        Some(m) => affine(m, b1, 0.0) + affine(g, 1.0 - b1, 0.0),
        None => affine(g, 1.0 - b1, 0.0),
    };
    let g2 = g * g;
    let v = match v {
        Some(v) => affine(v, b2, 0.0) + affine(g2, 1.0 - b2, 0.0),
        None => affine(g2, 1.0 - b2, 0.0),
    };
    let denom = affine(affine(v.sqrt(), 1.0 / s.bc2_sqrt, 0.0), 1.0, s.eps);
    let decayed = if s.weight_decay != 0.0 {
        affine(p, 1.0 - s.lr * s.weight_decay, 0.0)
    } else {
        p
    };
    (decayed - affine(m / denom, s.step_size, 0.0), m, v)
}
