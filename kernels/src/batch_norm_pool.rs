//! Batch norm in training, its ReLU, zero padding and max pooling as one op: a CNN block's tail
//! (Conv4's `conv, BN, ReLU, 2x2 max pool`, ResNet's stem `conv, BN, ReLU, pad 1, 3x3/2 max
//! pool`).
//!
//! Separately, the batch norm's op ([`crate::batch_norm`]) returns its output, the pool's op
//! keeps it for its backward, and candle's backward gives the pool's input gradient a zero
//! tensor to add into (a fill and an add of the map's size); the stem's padding adds two more
//! maps, each kept. Conv4's first block at 84 px, 85 images: 153 MB for the normalised map
//! alone, kept from the forward to the backward. Here the forward normalises one plane at a
//! time into a thread's buffer, pools it there and writes only the pooled plane; the graph keeps
//! the input and the (4x smaller) output. The backward normalises each plane again (the same
//! per-channel `a` and `b`, so the same values bit for bit), finds each window's first maximum
//! in it as the pool does, writes the input-side gradient, and runs the batch norm's backward
//! over it in place (one map of the input's size in the backward, not two): the gradients are
//! the separate ops' bit for bit (tested; the sum into a zero tensor this skips changes no
//! bits: the gradient candle hands an op is itself such a sum, never a negative zero), with the
//! normalised map never kept and no zero tensor to add into.
//!
//! [`affine_relu_max_pool`] is evaluation's form (running statistics, no graph): the same pass
//! with a given per-channel scale and shift, computed in the dtype as the separate ops compute
//! them, so the values are theirs bit for bit; one map written where they write four (six
//! with padding), each a fresh allocation.
//!
//! CPU, f32 and f64, where the batch norm's op runs ([`crate::batch_norm`]);
//! `FT_BN_POOL_OP=0` (or the batch norm's `FT_BATCH_NORM_OP=0`) runs the separate ops (for a
//! before-and-after measurement), as do other devices and dtypes.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, WithDType,
};
use rayon::prelude::*;

use crate::batch_norm::{self, affine, normalise, slice, BatchStats, Float, Planes};
use crate::pool::{self, Pool};

/// The pooling after the ReLU: zero padding on every side, then max pooling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxPool {
    pub pad: usize,
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
}

impl MaxPool {
    /// A `k` x `k` window moving by `s`, over the map padded by `pad` zeros.
    pub fn square(k: usize, s: usize, pad: usize) -> Self {
        MaxPool {
            pad,
            kernel: (k, k),
            stride: (s, s),
        }
    }
}

/// `max_pool2d(pad(relu(batch_norm_train(x))))` for `x` [N, C, H, W] with `weight` and `bias`
/// [C], and the batch statistics (as [`batch_norm::batch_norm_train`]). One op on the CPU in
/// f32 and f64 (see the module); elsewhere the separate ops, with the same values.
pub fn batch_norm_relu_max_pool_train(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    pool: MaxPool,
) -> Result<(Tensor, BatchStats)> {
    if !(batch_norm::takes(x) && op_enabled()) {
        return separate(x, weight, bias, eps, pool);
    }
    batch_norm::with_statistics(x, weight, bias, |stats| Forward {
        pool,
        map: Map::Batch { eps, stats },
    })
}

/// The training op, its batch statistics left in `stats`, for an op that runs it inside its own
/// (`crate::conv`'s convolution + batch norm); `None` where `FT_BN_POOL_OP=0` turns it off.
pub(crate) fn train_op(
    eps: f64,
    pool: MaxPool,
    stats: Arc<Mutex<BatchStats>>,
) -> Option<Box<dyn CustomOp3 + Send + Sync>> {
    op_enabled().then(|| {
        Box::new(Forward {
            pool,
            map: Map::Batch { eps, stats },
        }) as Box<dyn CustomOp3 + Send + Sync>
    })
}

/// The separate ops the op replaces: the batch norm's op with its ReLU, the zero padding, the
/// pool's op. The reference the op is tested against, and the path of other devices and dtypes.
pub fn separate(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    pool: MaxPool,
) -> Result<(Tensor, BatchStats)> {
    let (y, stats) = batch_norm::batch_norm_relu_train(x, weight, bias, eps)?;
    let y = match pool.pad {
        0 => y,
        p => y.pad_with_zeros(2, p, p)?.pad_with_zeros(3, p, p)?,
    };
    Ok((pool::max_pool2d(&y, pool.kernel, pool.stride)?, stats))
}

/// `max_pool2d(pad(relu(x * scale + shift)))` for `x` [N, C, H, W] and `scale`, `shift` [C] (the
/// running statistics' affine map, in evaluation), with no graph: one op on the CPU in f32 and
/// f64 (each value `x * scale`, then `+ shift`, rounded in the dtype as the separate ops round
/// them); elsewhere the separate ops, detached.
pub fn affine_relu_max_pool(
    x: &Tensor,
    scale: &Tensor,
    shift: &Tensor,
    pool: MaxPool,
) -> Result<Tensor> {
    let (n_scale, n_shift, c) = (scale.elem_count(), shift.elem_count(), x.dim(1)?);
    if n_scale != c || n_shift != c {
        bail!("affine + max pool: {c} channels, scale of {n_scale} and shift of {n_shift}");
    }
    if batch_norm::takes(x) && op_enabled() {
        let dt = x.dtype();
        let flat = |t: &Tensor| t.detach().to_dtype(dt)?.reshape(c)?.contiguous();
        return x.detach().contiguous()?.apply_op3_no_bwd(
            &flat(scale)?,
            &flat(shift)?,
            &Forward {
                pool,
                map: Map::Given,
            },
        );
    }
    let shape = (1, x.dim(1)?, 1, 1);
    let y = x
        .detach()
        .broadcast_mul(&scale.detach().reshape(shape)?)?
        .broadcast_add(&shift.detach().reshape(shape)?)?;
    let y = match pool.pad {
        0 => crate::activation::relu(&y)?,
        p => crate::activation::relu(&y)?
            .pad_with_zeros(2, p, p)?
            .pad_with_zeros(3, p, p)?,
    };
    pool::max_pool2d(&y, pool.kernel, pool.stride)
}

/// The ops' names in their errors.
const TRAIN: &str = "batch norm + max pool";
const INFER: &str = "affine + max pool";

/// `FT_BN_POOL_OP=0` turns the op off.
fn op_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switched_on(&ON, "FT_BN_POOL_OP")
}

/// Sizes of one plane, padded, and of its pooled output.
#[derive(Clone, Copy)]
struct Frame {
    h: usize,
    w: usize,
    pad: usize,
    /// The padded plane's width.
    wp: usize,
    /// Values in the padded plane, and in the pooled one.
    padded: usize,
    pooled: usize,
    /// The pooled plane's height and width.
    oh: usize,
    ow: usize,
}

impl Frame {
    fn of(pool: &MaxPool, p: &Pool, dims: &[usize], op: &str) -> Result<Self> {
        let [_, _, h, w] = *dims else {
            bail!("{op} expects [N, C, H, W], got {dims:?}");
        };
        let (hp, wp) = (h + 2 * pool.pad, w + 2 * pool.pad);
        let (oh, ow) = p.out_hw(hp, wp)?;
        Ok(Frame {
            h,
            w,
            pad: pool.pad,
            wp,
            padded: hp * wp,
            pooled: oh * ow,
            oh,
            ow,
        })
    }

    /// Plane `x` through `f` (a row at a time) into the interior of `padded`, whose border
    /// stays as it is (zero).
    fn fill<T>(&self, x: &[T], padded: &mut [T], f: impl Fn(&[T], &mut [T])) {
        if self.pad == 0 {
            return f(x, padded);
        }
        for (row, xs) in x.chunks_exact(self.w).enumerate() {
            let at = (row + self.pad) * self.wp + self.pad;
            f(xs, &mut padded[at..at + self.w]);
        }
    }

    /// Every plane of `x` through `f` (given the plane's channel) and pooled: the pooled map.
    fn pooled<T: WithDType>(
        &self,
        x: &[T],
        p: Planes,
        pool: &Pool,
        f: impl Fn(usize, &[T], &mut [T]) + Sync,
    ) -> Vec<T> {
        let mut out = vec![T::zero(); p.n * p.c * self.pooled];
        if self.pooled > 0 && p.hw > 0 {
            out.par_chunks_mut(self.pooled)
                .zip(x.par_chunks(p.hw))
                .enumerate()
                .for_each_init(
                    || vec![T::zero(); self.padded],
                    |padded, (plane, (o, xp))| {
                        self.fill(xp, padded, |x, y| f(plane % p.c, x, y));
                        pool.plane(padded, self.wp, o, None);
                    },
                );
        }
        out
    }

    /// The interior of padded plane `from` into `to` (one plane, unpadded).
    fn crop<T: Copy>(&self, from: &[T], to: &mut [T]) {
        for (row, out) in to.chunks_exact_mut(self.w).enumerate() {
            let at = (row + self.pad) * self.wp + self.pad;
            out.copy_from_slice(&from[at..at + self.w]);
        }
    }
}

/// The forward: each plane through its channel's affine map and the ReLU into a thread's
/// buffer, and pooled there.
struct Forward {
    pool: MaxPool,
    map: Map,
}

/// Where the per-channel affine map comes from.
enum Map {
    /// Training: the batch statistics (left in `stats` for the caller and the backward), with
    /// the op's second and third inputs the weight and bias; `x * a + b` in f64, rounded once,
    /// as the batch norm's op computes it.
    Batch {
        eps: f64,
        stats: Arc<Mutex<BatchStats>>,
    },
    /// Evaluation: the second and third inputs are the scale and shift themselves; `x * scale`
    /// then `+ shift` in the dtype, as candle's broadcast multiply and add round. No backward.
    Given,
}

impl Forward {
    fn name(&self) -> &'static str {
        match self.map {
            Map::Batch { .. } => TRAIN,
            Map::Given => INFER,
        }
    }

    fn run<T: Float>(&self, x: &[T], dims: &[usize], p1: &[T], p2: &[T]) -> Result<Vec<T>> {
        let p = Planes::of(&Shape::from(dims))?;
        let pool = Pool::max(self.pool.kernel, self.pool.stride);
        let f = Frame::of(&self.pool, &pool, dims, self.name())?;
        match &self.map {
            Map::Batch { eps, stats } => {
                let (s, a, b) = affine(x, p, p1, p2, *eps)?;
                let out = f.pooled(x, p, &pool, |c, x, y| normalise(x, a[c], b[c], true, y));
                batch_norm::put(stats, s)?;
                Ok(out)
            }
            Map::Given if p1.len() != p.c || p2.len() != p.c => {
                bail!(
                    "{INFER}: {} channels, scale of {}, shift of {}",
                    p.c,
                    p1.len(),
                    p2.len()
                )
            }
            Map::Given => Ok(f.pooled(x, p, &pool, |c, x, y| {
                let (a, b) = (p1[c], p2[c]);
                for (o, &v) in y.iter_mut().zip(x) {
                    let v = v * a + b;
                    *o = if v > T::zero() { v } else { T::zero() };
                }
            })),
        }
    }
}

impl CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        match self.map {
            Map::Batch { .. } => "ft-batch-norm-relu-max-pool",
            Map::Given => "ft-affine-relu-max-pool",
        }
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = xl.dims();
        let pool = Pool::max(self.pool.kernel, self.pool.stride);
        let f = Frame::of(&self.pool, &pool, dims, Forward::name(self))?;
        let y = match xs {
            CpuStorage::F32(_) => CpuStorage::F32(self.run(
                slice::<f32>(xs, xl, "the input")?,
                dims,
                slice(s1, l1, "the weight or scale")?,
                slice(s2, l2, "the bias or shift")?,
            )?),
            CpuStorage::F64(_) => CpuStorage::F64(self.run(
                slice::<f64>(xs, xl, "the input")?,
                dims,
                slice(s1, l1, "the weight or scale")?,
                slice(s2, l2, "the bias or shift")?,
            )?),
            other => bail!(
                "{}: {:?} input (f32 or f64)",
                Forward::name(self),
                other.dtype()
            ),
        };
        Ok((y, Shape::from((dims[0], dims[1], f.oh, f.ow))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Map::Batch { eps, stats } = &self.map else {
            bail!("{}: evaluation's op has no backward", Forward::name(self));
        };
        let (eps, stats) = (*eps, batch_norm::taken(stats)?);
        // The gradient at the ReLU's output, and the batch norm's backward (with its ReLU) over
        // it in place: one map of the input's size.
        let norm = batch_norm::Backward::new(gamma, beta, stats, eps, true)?;
        let Some((a, b)) = norm.relu.clone() else {
            bail!(
                "{}: the batch norm's backward has no ReLU",
                Forward::name(self)
            );
        };
        let unpool = Unpool {
            a,
            b,
            pool: self.pool,
            norm,
        };
        let dx = x.apply_op2_no_bwd(&dy.contiguous()?, &unpool)?;
        let (dgamma, dbeta) = unpool.norm.gradients(gamma)?;
        Ok((Some(dx), Some(dgamma), Some(dbeta)))
    }
}

/// The pooling's backward from the input (normalised again plane by plane) and the pooled
/// output's gradient: the gradient at the ReLU's output, the input's size, over which the batch
/// norm's backward (`norm`) then runs in place: the input's gradient.
struct Unpool {
    a: Vec<f64>,
    b: Vec<f64>,
    pool: MaxPool,
    norm: batch_norm::Backward,
}

impl Unpool {
    fn run<T: Float>(&self, x: &[T], g: &[T], dims: &[usize]) -> Result<Vec<T>> {
        let p = Planes::of(&Shape::from(dims))?;
        let pool = Pool::max(self.pool.kernel, self.pool.stride);
        let f = Frame::of(&self.pool, &pool, dims, TRAIN)?;
        if g.len() != p.n * p.c * f.pooled {
            bail!(
                "batch norm + max pool backward: gradient of {} values for {}x{}x{}x{}",
                g.len(),
                p.n,
                p.c,
                f.oh,
                f.ow
            );
        }
        let mut dh = vec![T::zero(); x.len()];
        if f.pooled == 0 || p.hw == 0 {
            self.norm.run_in_place(x, &mut dh, p)?;
            return Ok(dh);
        }
        let (hp, wp) = (f.h + 2 * f.pad, f.wp);
        dh.par_chunks_mut(p.hw)
            .zip(x.par_chunks(p.hw))
            .zip(g.par_chunks(f.pooled))
            .enumerate()
            .for_each_init(
                || {
                    // The normalised plane and, with padding, its gradient (padded: the
                    // windows over the border send theirs there, where it stops, as the
                    // padding's backward drops it).
                    let grad = vec![T::zero(); if f.pad > 0 { f.padded } else { 0 }];
                    (vec![T::zero(); f.padded], grad, pool.scratch::<T>(hp, wp))
                },
                |(padded, grad, scratch), (plane, ((dhp, xp), gp))| {
                    let (a, b) = (self.a[plane % p.c], self.b[plane % p.c]);
                    f.fill(xp, padded, |x, y| normalise(x, a, b, true, y));
                    if f.pad == 0 {
                        pool.plane_backward(padded, wp, gp, dhp, scratch);
                    } else {
                        pool.plane_backward(padded, wp, gp, grad, scratch);
                        f.crop(grad, dhp);
                        grad.fill(T::zero());
                    }
                },
            );
        self.norm.run_in_place(x, &mut dh, p)?;
        Ok(dh)
    }
}

impl CustomOp2 for Unpool {
    fn name(&self) -> &'static str {
        "ft-batch-norm-relu-max-pool-backward"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = xl.dims();
        let dh = match (xs, gs) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(self.run(
                slice::<f32>(xs, xl, "the input")?,
                slice(gs, gl, "the gradient")?,
                dims,
            )?),
            (CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(self.run(
                slice::<f64>(xs, xl, "the input")?,
                slice(gs, gl, "the gradient")?,
                dims,
            )?),
            _ => bail!(
                "batch norm + max pool backward: {:?} input and {:?} gradient (f32 or f64, the same)",
                xs.dtype(),
                gs.dtype()
            ),
        };
        Ok((dh, xl.shape().clone()))
    }
}
