//! AdamW on the CPU in one threaded pass per parameter.
//!
//! With the optimizer state offloaded (`StatePlacement::Host`) every step of a 2.6-2.9B model
//! runs here: op by op (about fifteen single-threaded passes over fp32 tensors) that is about
//! 40 ns per parameter on the 2-core development VM, near two minutes per step at FLAN-T5-XL
//! size. This pass reads the master, both moments and the gradient once, writes the master and
//! the moments back in place, and splits the work over the machine's cores, as DeepSpeed's CPU
//! Adam does; the step's constants are turned into f32 once, so the loop vectorizes (on the
//! t5-small-sized bench, 89.5M parameters: 0.9 s -> 0.26 s a step). Each element is
//! computed with exactly the f32 operations, in the same order, that the op-by-op update
//! (`AdamW::step`'s reference path, i.e. candle's `affine` and binary kernels) performs, so the
//! two give identical bits (tested in `tests/host_ops.rs`).

use candle_core::{Result, Tensor};

// `Widen`: a bf16/f16 gradient is read as it is and widened per element (no f32 copy).
use ft_kernels::host::{storage_key, with_f32_mut, with_slice, Widen, CHUNK};

/// The per-step constants of the update, in f64 as the optimizer computes them;
/// [`HostStep::consts`] turns them into f32 as the op-by-op path does.
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

/// `$body` with `$g` bound to the gradient's elements in their own dtype (f32, bf16 or f16,
/// contiguous on the CPU); `None` for any other tensor.
macro_rules! with_grad {
    ($t:expr, |$g:ident| $body:expr) => {
        match $t.dtype() {
            candle_core::DType::F32 => with_slice::<f32, _>($t, |$g| $body),
            candle_core::DType::BF16 => with_slice::<half::bf16, _>($t, |$g| $body),
            candle_core::DType::F16 => with_slice::<half::f16, _>($t, |$g| $body),
            _ => None,
        }
    };
}

/// Whether no two of `ts` share a storage: [`with_f32_mut`] write-locks one while the others
/// are locked, which would wait forever on a shared one.
fn distinct(ts: &[&Tensor]) -> bool {
    let keys: Vec<usize> = ts.iter().map(|t| storage_key(t)).collect();
    keys.iter().enumerate().all(|(i, k)| !keys[..i].contains(k))
}

/// The first AdamW update of `p` (contiguous f32 on the CPU) with gradient `g` (f32, bf16 or
/// f16, contiguous on the CPU, `p`'s length), no moments yet: `p` is written in place (as
/// `Var::set` writes it) and the new moments are returned. `Ok(None)` when a tensor is not of
/// that kind (the caller then takes the op-by-op path).
pub(crate) fn first_update(
    p: &Tensor,
    g: &Tensor,
    s: &HostStep,
) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
    if g.dims() != p.dims() || !distinct(&[p, g]) {
        return Ok(None);
    }
    let c = s.consts();
    let done = with_grad!(g, |g| {
        with_f32_mut(p, |p| {
            let (mut m, mut v) = (vec![0f32; p.len()], vec![0f32; p.len()]);
            par_zip(
                p,
                g,
                &mut m,
                &mut v,
                #[inline(always)]
                |p, g, m, v| {
                    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                        (*p, *m, *v) = element(*p, g.widen(), None, None, &c);
                    }
                },
            );
            (m, v)
        })
    });
    Ok(done.transpose()?.flatten())
}

/// A later AdamW update: `p`, `m` and `v` (contiguous f32 CPU tensors of `g`'s shape, no two
/// sharing a storage) are read and written in place, `g` (f32, bf16 or f16) read. `Ok(false)`
/// when a tensor is not of that kind. Nothing is allocated: fresh buffers for the three
/// results (1 GiB a step at 90M parameters) cost more in page faults than the arithmetic.
pub(crate) fn update_in_place(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    s: &HostStep,
) -> Result<bool> {
    if [g, m, v].iter().any(|t| t.dims() != p.dims()) || !distinct(&[p, g, m, v]) {
        return Ok(false);
    }
    // Each level: Ok(Some(..)) when its tensor was f32, contiguous and on the CPU.
    fn level<R>(r: Result<Option<Result<Option<R>>>>) -> Result<Option<R>> {
        Ok(r?.transpose()?.flatten())
    }
    let c = s.consts();
    let done = with_grad!(g, |g| {
        level(with_f32_mut(m, |m| {
            level(with_f32_mut(v, |v| {
                with_f32_mut(p, |p| {
                    par_zip(
                        p,
                        g,
                        m,
                        v,
                        #[inline(always)]
                        |p, g, m, v| {
                            for (((p, g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                                (*p, *m, *v) = element(*p, g.widen(), Some(*m), Some(*v), &c);
                            }
                        },
                    )
                })
            }))
        }))
    });
    Ok(done.transpose()?.flatten().is_some())
}

/// `f` over matching chunks of the four slices (of one length) on rayon's threads, each chunk
/// on the CPU's widest vector unit (`ft_kernels::wide::run`; `f` marked `#[inline(always)]` so
/// that it is compiled there: 4 to 16 lanes, about 10% off 31M parameters' step here, the same
/// operations on each element).
fn par_zip<G: Sync>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    f: impl Fn(&mut [f32], &[G], &mut [f32], &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    p.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .for_each(|(((p, g), m), v)| {
            ft_kernels::wide::run(
                #[inline(always)]
                || f(p, g, m, v),
            )
        });
}

impl HostStep {
    /// The step's constants as the op-by-op path's `affine` turns them into f32, once per step
    /// rather than once per element (a loop that converts them per element does not vectorize).
    pub(crate) fn consts(&self) -> StepConsts {
        StepConsts {
            grad_mul: (self.grad_mul != 1.0).then_some(self.grad_mul as f32),
            beta1: self.beta1 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            inv_bc2_sqrt: (1.0 / self.bc2_sqrt) as f32,
            eps: self.eps as f32,
            decay: (self.weight_decay != 0.0).then_some((1.0 - self.lr * self.weight_decay) as f32),
            step_size: self.step_size as f32,
        }
    }
}

/// [`HostStep`] in f32 (see [`HostStep::consts`]); `None` for a factor that is not applied.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepConsts {
    grad_mul: Option<f32>,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    inv_bc2_sqrt: f32,
    eps: f32,
    decay: Option<f32>,
    step_size: f32,
}

/// One element's update (new weight, first and second moment), operation for operation as the
/// op-by-op path: `x * mul + add` is candle's `affine` (the `+ 0.0` included: it turns -0.0
/// into 0.0 there too; `x * 1.0` is left out, being `x` exactly). `None` moments are the first
/// step's.
#[inline(always)]
pub(crate) fn element(
    p: f32,
    g: f32,
    m: Option<f32>,
    v: Option<f32>,
    c: &StepConsts,
) -> (f32, f32, f32) {
    let affine = |x: f32, mul: f32| x * mul + 0.0;
    let g = match c.grad_mul {
        Some(k) => affine(g, k),
        None => g,
    };
    let m = match m {
        Some(m) => affine(m, c.beta1) + affine(g, c.one_minus_beta1),
        None => affine(g, c.one_minus_beta1),
    };
    let g2 = g * g;
    let v = match v {
        Some(v) => affine(v, c.beta2) + affine(g2, c.one_minus_beta2),
        None => affine(g2, c.one_minus_beta2),
    };
    let denom = affine(v.sqrt(), c.inv_bc2_sqrt) + c.eps;
    let decayed = match c.decay {
        Some(d) => affine(p, d),
        None => p,
    };
    (decayed - affine(m / denom, c.step_size), m, v)
}
