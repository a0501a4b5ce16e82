//! Batch normalisation in training (batch statistics) as one op forward and one op backward.
//!
//! As a composition of candle ops, `BatchNorm2d` over [N, C, H, W] makes a mean over three
//! dimensions one at a time, the centred input, its square, the variance, the normalised, scaled
//! and shifted output: six tensors of the input's size, each a fresh allocation the graph keeps,
//! and a backward through all of them (fewshot-ft's Conv4 episode at 84 px: 1.33 GiB of its
//! first block's 1.8, and a third of the step in page faults on those fresh buffers, #21). Here
//! the forward reads the input twice per channel (mean, then the centred sum of squares, both in
//! f64) and writes the output once; the op keeps its input, and its batch statistics for the
//! backward, which computes
//!
//! ```text
//! dbeta  = sum(dy)            dgamma = sum(dy * xhat)          (per channel, in f64)
//! dx     = gamma * rstd / M * (M * dy - dbeta - xhat * dgamma)
//! ```
//!
//! with M = N H W, in two passes. Channels (statistics) and planes (outputs) run on rayon's
//! threads. CPU, f32 and f64; other devices and dtypes take [`batch_norm_train`]'s composition.
//!
//! [`batch_norm_relu_train`] is the same op with the ReLU that follows it in a conv block
//! inside: the forward writes `max(y, 0)`, the backward zeroes `dy` where `y <= 0` (as
//! PyTorch's ReLU backward) from `y` recomputed out of the input and the statistics. Candle's
//! ReLU would make one more map of the input's size in forward, which its graph keeps, and
//! five in backward (the zeros it accumulates into, zeros to compare with, the mask, the mask as
//! floats, the product; the 84 px Conv4 episode's maps are 153 MB each).

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu::{lane_sum, LANES};

mod backward;

pub(crate) use backward::{backward, Backward};

/// The batch statistics of one forward: per channel, the mean and the biased variance.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchStats {
    pub mean: Vec<f64>,
    pub var: Vec<f64>,
}

/// Geometry of [N, C, H, W]: planes of `hw` values, `c` channels.
#[derive(Clone, Copy)]
pub(crate) struct Planes {
    pub(crate) n: usize,
    pub(crate) c: usize,
    pub(crate) hw: usize,
}

impl Planes {
    pub(crate) fn of(shape: &Shape) -> Result<Self> {
        let dims = shape.dims();
        if dims.len() < 2 {
            bail!("batch norm expects [N, C, ...], got {dims:?}");
        }
        Ok(Planes {
            n: dims[0],
            c: dims[1],
            hw: dims[2..].iter().product(),
        })
    }

    /// Values per channel.
    fn m(&self) -> usize {
        self.n * self.hw
    }

    /// Channel `c`'s planes of `x`.
    fn channel<T>(self, x: &[T], c: usize) -> impl Iterator<Item = &[T]> {
        (0..self.n).map(move |n| {
            let at = (n * self.c + c) * self.hw;
            &x[at..at + self.hw]
        })
    }
}

/// A float the passes read and write (f32 or f64); sums are f64 either way.
pub(crate) trait Float: Copy + Send + Sync + candle_core::WithDType {
    fn f64(self) -> f64;
    fn of(v: f64) -> Self;
}

impl Float for f32 {
    fn f64(self) -> f64 {
        self as f64
    }
    fn of(v: f64) -> Self {
        v as f32
    }
}

impl Float for f64 {
    fn f64(self) -> f64 {
        self
    }
    fn of(v: f64) -> Self {
        v
    }
}

/// The two sums `(sum(f(x, dy).0), sum(f(x, dy).1))` over paired values, as [`lane_sum`].
#[inline(always)]
pub(crate) fn lane_sum2<T: Float>(
    xs: &[T],
    ys: &[T],
    f: impl Fn(f64, f64) -> (f64, f64),
) -> (f64, f64) {
    debug_assert_eq!(xs.len(), ys.len(), "lane_sum2 pairs slices of one length");
    crate::wide::run(
        #[inline(always)]
        move || {
            let (mut a0, mut a1) = ([0f64; LANES], [0f64; LANES]);
            let mut xc = xs.chunks_exact(LANES);
            let mut yc = ys.chunks_exact(LANES);
            for (x, y) in (&mut xc).zip(&mut yc) {
                for i in 0..LANES {
                    let (u, v) = f(x[i].f64(), y[i].f64());
                    a0[i] += u;
                    a1[i] += v;
                }
            }
            let (mut t0, mut t1) = (0f64, 0f64);
            for (x, y) in xc.remainder().iter().zip(yc.remainder()) {
                let (u, v) = f(x.f64(), y.f64());
                t0 += u;
                t1 += v;
            }
            (a0.iter().sum::<f64>() + t0, a1.iter().sum::<f64>() + t1)
        },
    )
}

/// Per channel: the mean and the biased variance of `x`, two passes in f64.
pub(crate) fn stats<T: Float>(x: &[T], p: Planes) -> BatchStats {
    let m = p.m().max(1) as f64;
    let (mean, var) = (0..p.c)
        .into_par_iter()
        .map(|c| {
            let mean = p
                .channel(x, c)
                .map(|plane| {
                    lane_sum(
                        plane,
                        #[inline(always)]
                        |v| v,
                    )
                })
                .sum::<f64>()
                / m;
            let var = p
                .channel(x, c)
                .map(|plane| {
                    lane_sum(
                        plane,
                        #[inline(always)]
                        |v| (v - mean) * (v - mean),
                    )
                })
                .sum::<f64>()
                / m;
            (mean, var)
        })
        .unzip();
    BatchStats { mean, var }
}

/// `1 / sqrt(var + eps)` per channel.
pub(crate) fn rstd(s: &BatchStats, eps: f64) -> Vec<f64> {
    s.var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect()
}

/// Per channel, `a` and `b` of the forward's `y = x * a + b`: the fused ReLU's backward finds
/// where `y > 0` with these same values, so its mask is the forward's, bit for bit.
pub(crate) fn scale_shift(
    s: &BatchStats,
    r: &[f64],
    gamma: &[f64],
    beta: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let a: Vec<f64> = r.iter().zip(gamma).map(|(r, g)| r * g).collect();
    let b = (0..a.len()).map(|c| beta[c] - s.mean[c] * a[c]).collect();
    (a, b)
}

/// One plane's `x * a + b` into `out` (and `max(_, 0)` with `relu`), rounded once: the values
/// of the forward, which the fused pooling (`crate::batch_norm_pool`) recomputes bit for bit.
pub(crate) fn normalise<T: Float>(x: &[T], a: f64, b: f64, relu: bool, out: &mut [T]) {
    crate::wide::run(
        #[inline(always)]
        move || {
            if relu {
                for (o, v) in out.iter_mut().zip(x) {
                    *o = T::of((v.f64() * a + b).max(0.0));
                }
            } else {
                for (o, v) in out.iter_mut().zip(x) {
                    *o = T::of(v.f64() * a + b);
                }
            }
        },
    )
}

/// The forward: `y = (x - mean) * rstd * gamma + beta` (then `max(y, 0)` with `relu`), its
/// statistics left in `stats`.
struct Forward {
    eps: f64,
    relu: bool,
    stats: Arc<Mutex<BatchStats>>,
}

pub(crate) fn slice<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => bail!("batch norm: {what} must be contiguous"),
    }
}

impl Forward {
    fn run<T: Float>(&self, x: &[T], p: Planes, gamma: &[T], beta: &[T]) -> Result<Vec<T>> {
        let (s, a, b) = affine(x, p, gamma, beta, self.eps)?;
        let mut y = vec![T::of(0.0); x.len()];
        if p.hw > 0 {
            y.par_chunks_mut(p.hw).enumerate().for_each(|(plane, out)| {
                let c = plane % p.c;
                let at = plane * p.hw;
                normalise(&x[at..at + p.hw], a[c], b[c], self.relu, out);
            });
        }
        put(&self.stats, s)?;
        Ok(y)
    }
}

/// The batch statistics of `x` and, per channel, `a` and `b` of the forward's `y = x * a + b`.
pub(crate) type Affine = (BatchStats, Vec<f64>, Vec<f64>);

/// [`Affine`] of `x` with the weight `gamma` and bias `beta` (one value per channel, checked).
pub(crate) fn affine<T: Float>(
    x: &[T],
    p: Planes,
    gamma: &[T],
    beta: &[T],
    eps: f64,
) -> Result<Affine> {
    if gamma.len() != p.c || beta.len() != p.c {
        bail!(
            "batch norm: {} channels, weight of {} and bias of {}",
            p.c,
            gamma.len(),
            beta.len()
        );
    }
    let s = stats(x, p);
    let r = rstd(&s, eps);
    let wide = |v: &[T]| v.iter().map(|g| g.f64()).collect::<Vec<f64>>();
    let (a, b) = scale_shift(&s, &r, &wide(gamma), &wide(beta));
    Ok((s, a, b))
}

/// Leaves a forward's statistics where its caller and its backward read them.
pub(crate) fn put(slot: &Mutex<BatchStats>, s: BatchStats) -> Result<()> {
    *slot
        .lock()
        .map_err(|_| candle_core::Error::Msg("batch norm: statistics poisoned".into()))? = s;
    Ok(())
}

/// A forward's statistics.
pub(crate) fn taken(slot: &Mutex<BatchStats>) -> Result<BatchStats> {
    Ok(slot
        .lock()
        .map_err(|_| candle_core::Error::Msg("batch norm: statistics poisoned".into()))?
        .clone())
}

impl CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        if self.relu {
            "ft-batch-norm-relu"
        } else {
            "ft-batch-norm"
        }
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let p = Planes::of(xl.shape())?;
        let y = match xs {
            CpuStorage::F32(_) => CpuStorage::F32(self.run(
                slice::<f32>(xs, xl, "the input")?,
                p,
                slice(ws, wl, "the weight")?,
                slice(bs, bl, "the bias")?,
            )?),
            CpuStorage::F64(_) => CpuStorage::F64(self.run(
                slice::<f64>(xs, xl, "the input")?,
                p,
                slice(ws, wl, "the weight")?,
                slice(bs, bl, "the bias")?,
            )?),
            other => bail!("batch norm: {:?} input (f32 or f64)", other.dtype()),
        };
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let stats = taken(&self.stats)?;
        let (dx, dgamma, dbeta) = backward(x, gamma, beta, dy, stats, self.eps, self.relu)?;
        Ok((Some(dx), Some(dgamma), Some(dbeta)))
    }
}

/// Batch norm of `x` ([N, C, H, W]) with its batch statistics, scaled by `weight` and shifted by
/// `bias` ([C] each), as `torch.nn.functional.batch_norm(training=True)` computes it; also
/// returns the statistics (mean and biased variance per channel, for the running estimates).
/// One op on the CPU for f32 and f64 (see the module); elsewhere a composition of candle ops
/// with the same values and gradients.
pub fn batch_norm_train(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, BatchStats)> {
    train(x, weight, bias, eps, false)
}

/// [`batch_norm_train`] followed by a ReLU, as one op on the CPU for f32 and f64 (the ReLU's
/// gradient zero where the output is zero, as PyTorch's); elsewhere the composition and
/// candle's ReLU, whose gradient passes where the normalised value is exactly 0 (the two
/// differ only there).
pub fn batch_norm_relu_train(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, BatchStats)> {
    train(x, weight, bias, eps, true)
}

fn train(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    relu: bool,
) -> Result<(Tensor, BatchStats)> {
    if takes(x) {
        return with_statistics(x, weight, bias, |stats| Forward { eps, relu, stats });
    }
    let (y, s) = composed(x, weight, bias, eps)?;
    Ok((if relu { y.relu()? } else { y }, s))
}

/// `op` (made around the slot its forward leaves the batch statistics in) applied to `x`, the
/// weight and the bias in `x`'s dtype; its output and those statistics.
pub(crate) fn with_statistics<O: CustomOp3 + Send + Sync + 'static>(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    op: impl FnOnce(Arc<Mutex<BatchStats>>) -> O,
) -> Result<(Tensor, BatchStats)> {
    let stats = Arc::new(Mutex::new(BatchStats::default()));
    let y = x.contiguous()?.apply_op3(
        &weight.to_dtype(x.dtype())?.contiguous()?,
        &bias.to_dtype(x.dtype())?.contiguous()?,
        op(stats.clone()),
    )?;
    Ok((y, taken(&stats)?))
}

/// The training op (with its ReLU when `relu`) that leaves its batch statistics in `stats`, for
/// an op that runs it inside its own (`crate::conv`'s convolution + batch norm).
pub(crate) fn train_op(
    eps: f64,
    relu: bool,
    stats: Arc<Mutex<BatchStats>>,
) -> Box<dyn CustomOp3 + Send + Sync> {
    Box::new(Forward { eps, relu, stats })
}

/// Whether `x` takes the op: f32 or f64 on the CPU, unless turned off ([`op_enabled`]).
pub(crate) fn takes(x: &Tensor) -> bool {
    x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64) && op_enabled()
}

/// Whether the CPU takes the op: `FT_BATCH_NORM_OP=0` turns it off (the composition then runs,
/// for a before-and-after measurement), like the CUDA kernels' switches.
fn op_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switched_on(&ON, "FT_BATCH_NORM_OP")
}

/// [`batch_norm_train`] as candle's ops over [N, C, H, W] (a mean over one dimension at a time,
/// as `BatchNorm2d` computed before the op): the reference the op is tested against, and the
/// path of other devices and dtypes.
pub fn composed(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<(Tensor, BatchStats)> {
    let (_, c, _, _) = x.dims4()?;
    let shape = (1, c, 1, 1);
    let mean = x.mean_keepdim(0)?.mean_keepdim(2)?.mean_keepdim(3)?;
    let var = x
        .broadcast_sub(&mean)?
        .sqr()?
        .mean_keepdim(0)?
        .mean_keepdim(2)?
        .mean_keepdim(3)?;
    let y = x
        .broadcast_sub(&mean)?
        .broadcast_div(&(var.clone() + eps)?.sqrt()?)?
        .broadcast_mul(&weight.reshape(shape)?)?
        .broadcast_add(&bias.reshape(shape)?)?;
    let wide =
        |t: &Tensor| -> Result<Vec<f64>> { t.flatten_all()?.to_dtype(DType::F64)?.to_vec1() };
    let stats = BatchStats {
        mean: wide(&mean)?,
        var: wide(&var)?,
    };
    Ok((y, stats))
}
