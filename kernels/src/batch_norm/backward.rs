//! The batch norm's backward: per channel the sums `sum(dy)` and `sum(dy * xhat)` (dbeta and
//! dgamma, in f64), then the input gradient from them, either into a new map or in place over
//! the output gradient (the batch norm + pooling op's, whose output gradient is a map of its
//! own: one map of the input's size less in its backward, and one fresh allocation less).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{lane_sum2, rstd, scale_shift, slice, BatchStats, Float, Planes};

/// The gradients of the input, the weight and the bias from the output's, `dy` (with `relu`,
/// the gradient after the ReLU: it passes where the forward's `x * a + b` was positive).
pub(crate) fn backward(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    dy: &Tensor,
    stats: BatchStats,
    eps: f64,
    relu: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = Backward::new(gamma, beta, stats, eps, relu)?;
    let dx = x.apply_op2_no_bwd(&dy.contiguous()?, &op)?;
    let (dgamma, dbeta) = op.gradients(gamma)?;
    Ok((dx, dgamma, dbeta))
}

/// A [C] tensor's values in f64.
fn wide(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.to_vec1::<f64>()
}

/// The backward's passes: per channel sum(dy) and sum(dy * xhat) (left in `sums` as dgamma and
/// dbeta), then dx. With `relu` (the fused ReLU's backward: the forward's per-channel `a` and
/// `b`) `dy` counts only where the forward's `x * a + b` was positive.
pub(crate) struct Backward {
    mean: Vec<f64>,
    rstd: Vec<f64>,
    gamma: Vec<f64>,
    pub(crate) relu: Option<(Vec<f64>, Vec<f64>)>,
    sums: Mutex<(Vec<f64>, Vec<f64>)>,
}

/// Where pass 2 reads the output gradient: a map of its own, or the map it writes.
enum Source<'a, T> {
    Map(&'a [T]),
    InPlace,
}

impl Backward {
    /// The backward of a forward with `stats`, the weight `gamma` and the bias `beta` (which
    /// the fused ReLU's mask needs).
    pub(crate) fn new(
        gamma: &Tensor,
        beta: &Tensor,
        stats: BatchStats,
        eps: f64,
        relu: bool,
    ) -> Result<Self> {
        let (r, g) = (rstd(&stats, eps), wide(gamma)?);
        let relu = if relu {
            Some(scale_shift(&stats, &r, &g, &wide(beta)?))
        } else {
            None
        };
        Ok(Backward {
            rstd: r,
            mean: stats.mean,
            gamma: g,
            relu,
            sums: Mutex::new((Vec::new(), Vec::new())),
        })
    }

    /// dgamma and dbeta (in `gamma`'s dtype) from the last run's sums.
    pub(crate) fn gradients(&self, gamma: &Tensor) -> Result<(Tensor, Tensor)> {
        let (dgamma, dbeta) = self
            .sums
            .lock()
            .map_err(|_| candle_core::Error::Msg("batch norm: sums poisoned".into()))?
            .clone();
        let back = |v: Vec<f64>| -> Result<Tensor> {
            Tensor::from_vec(v, gamma.shape(), gamma.device())?.to_dtype(gamma.dtype())
        };
        Ok((back(dgamma)?, back(dbeta)?))
    }

    fn check<T>(x: &[T], dy: &[T]) -> Result<()> {
        if x.len() != dy.len() {
            bail!(
                "batch norm backward: gradient of {} values for an input of {}",
                dy.len(),
                x.len()
            );
        }
        Ok(())
    }

    fn run<T: Float>(&self, x: &[T], dy: &[T], p: Planes) -> Result<Vec<T>> {
        Self::check(x, dy)?;
        let mut dx = vec![T::of(0.0); x.len()];
        self.passes(x, Source::Map(dy), &mut dx, p)?;
        Ok(dx)
    }

    /// The input gradient written over the output gradient `g` (the same values as
    /// [`Self::run`]: each is read once, before its own write).
    pub(crate) fn run_in_place<T: Float>(&self, x: &[T], g: &mut [T], p: Planes) -> Result<()> {
        Self::check(x, g)?;
        self.passes(x, Source::InPlace, g, p)
    }

    fn passes<T: Float>(&self, x: &[T], dy: Source<T>, out: &mut [T], p: Planes) -> Result<()> {
        let sums = {
            let g: &[T] = match dy {
                Source::Map(d) => d,
                Source::InPlace => out,
            };
            self.sums(x, g, p)
        };
        self.input_grad(x, dy, out, p, &sums);
        *self
            .sums
            .lock()
            .map_err(|_| candle_core::Error::Msg("batch norm: sums poisoned".into()))? = sums;
        Ok(())
    }

    /// Per channel the forward's `x * a + b`, where the fused ReLU passed `dy` (> 0).
    fn mask(&self, c: usize) -> Option<(f64, f64)> {
        self.relu.as_ref().map(|(a, b)| (a[c], b[c]))
    }

    /// Pass 1: per channel (dgamma, dbeta) = (sum(dy * xhat), sum(dy)), in f64.
    fn sums<T: Float>(&self, x: &[T], dy: &[T], p: Planes) -> (Vec<f64>, Vec<f64>) {
        (0..p.c)
            .into_par_iter()
            .map(|c| {
                let (mean, r) = (self.mean[c], self.rstd[c]);
                let (mut sg, mut sb) = (0f64, 0f64);
                for (xp, gp) in p.channel(x, c).zip(p.channel(dy, c)) {
                    let (g, gx) = match self.mask(c) {
                        Some((a, b)) => lane_sum2(
                            xp,
                            gp,
                            #[inline(always)]
                            |v, g| {
                                let g = if v * a + b <= 0.0 { 0.0 } else { g };
                                (g, g * ((v - mean) * r))
                            },
                        ),
                        None => lane_sum2(
                            xp,
                            gp,
                            #[inline(always)]
                            |v, g| (g, g * ((v - mean) * r)),
                        ),
                    };
                    sb += g;
                    sg += gx;
                }
                (sg, sb)
            })
            .unzip()
    }

    /// Pass 2: dx = gamma * rstd / M * (M * dy - dbeta - xhat * dgamma), a plane at a time.
    fn input_grad<T: Float>(
        &self,
        x: &[T],
        dy: Source<T>,
        out: &mut [T],
        p: Planes,
        (dgamma, dbeta): &(Vec<f64>, Vec<f64>),
    ) {
        if p.hw == 0 {
            return;
        }
        let m = p.m().max(1) as f64;
        out.par_chunks_mut(p.hw)
            .enumerate()
            .for_each(|(plane, out)| {
                let c = plane % p.c;
                let (mean, r) = (self.mean[c], self.rstd[c]);
                let k = self.gamma[c] * r / m;
                let (sb, sg) = (dbeta[c], dgamma[c]);
                let at = plane * p.hw;
                let xs = &x[at..at + p.hw];
                let dx = |v: f64, g: f64| T::of(k * (m * g - sb - (v - mean) * r * sg));
                // The gradient that passes where the fused ReLU's input `v * a + b` was
                // positive (all of it without the ReLU); the mask chosen outside the loops.
                let cut = |v: f64, (a, b): (f64, f64)| v * a + b <= 0.0;
                match (&dy, self.mask(c)) {
                    (Source::Map(d), Some(ab)) => {
                        let gs = &d[at..at + p.hw];
                        crate::wide::run(
                            #[inline(always)]
                            move || {
                                for ((o, v), g) in out.iter_mut().zip(xs).zip(gs) {
                                    let v = v.f64();
                                    *o = dx(v, if cut(v, ab) { 0.0 } else { g.f64() });
                                }
                            },
                        )
                    }
                    (Source::Map(d), None) => {
                        let gs = &d[at..at + p.hw];
                        crate::wide::run(
                            #[inline(always)]
                            move || {
                                for ((o, v), g) in out.iter_mut().zip(xs).zip(gs) {
                                    *o = dx(v.f64(), g.f64());
                                }
                            },
                        )
                    }
                    (Source::InPlace, Some(ab)) => crate::wide::run(
                        #[inline(always)]
                        move || {
                            for (o, v) in out.iter_mut().zip(xs) {
                                let v = v.f64();
                                *o = dx(v, if cut(v, ab) { 0.0 } else { o.f64() });
                            }
                        },
                    ),
                    (Source::InPlace, None) => crate::wide::run(
                        #[inline(always)]
                        move || {
                            for (o, v) in out.iter_mut().zip(xs) {
                                *o = dx(v.f64(), o.f64());
                            }
                        },
                    ),
                }
            });
    }
}

impl CustomOp2 for Backward {
    fn name(&self) -> &'static str {
        "ft-batch-norm-backward"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if xl.shape() != gl.shape() {
            bail!(
                "batch norm backward: gradient {:?} for input {:?}",
                gl.shape(),
                xl.shape()
            );
        }
        let p = Planes::of(xl.shape())?;
        let dx = match (xs, gs) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(self.run(
                slice::<f32>(xs, xl, "the input")?,
                slice(gs, gl, "the gradient")?,
                p,
            )?),
            (CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(self.run(
                slice::<f64>(xs, xl, "the input")?,
                slice(gs, gl, "the gradient")?,
                p,
            )?),
            _ => bail!(
                "batch norm backward: {:?} input and {:?} gradient (f32 or f64, the same)",
                xs.dtype(),
                gs.dtype()
            ),
        };
        Ok((dx, xl.shape().clone()))
    }
}
