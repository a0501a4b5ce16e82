//! A normalisation with its affine part, and the activation after it, as one op: layer norm
//! (`(x - mean) * rstd * w + b`), T5's RMS norm (`x * rstd * w`) and group norm, the latter
//! optionally followed by SiLU as in every UNet and VAE ResNet block.
//!
//! As separate ops (the normalisation, a broadcast multiply, a broadcast add, the activation)
//! the graph keeps each intermediate for its successor's backward: the normalised values, the
//! scaled, the shifted; three tensors of the input's size beside the input for a group norm and
//! SiLU, two for a layer norm, one for an RMS norm. The backward then makes each of their
//! gradients, and candle fills a zero tensor and adds into it for every edge. Here the op keeps
//! only its input (and the weight and bias, which are parameters) and writes the output once;
//! the backward recomputes each row's statistics and makes the input's gradient in three passes
//! over the row (the gradient at the affine part's output, its sums, the input's gradient),
//! with the weight's and bias's gradients summed on the way:
//!
//! ```text
//! z   = xhat * w + b          dz  = act'(z) * dy        dw = sum(dz * xhat)   db = sum(dz)
//! dxh = dz * w                dx  = rstd * (dxh - mean(dxh) - xhat * mean(dxh * xhat))
//! ```
//!
//! (RMS norm: without `mean(dxh)` and `b`.) The forward rounds where the separate ops round
//! (the normalised value, the product, the sum, the activation), so its values are theirs, bit
//! for bit, in every dtype (tested); the backward sums in f64 where the separate ops summed in
//! the dtype, so its gradients agree with theirs within the dtype's rounding (tested). The
//! weight's and bias's sums are made per task of rows and added in the tasks' order, so they do
//! not depend on the number of threads.
//!
//! CPU: f32, f64, bf16 and f16. CUDA (f32, bf16, f16): `cuda/norm_affine.cu`, the forward rounded at the same places
//! (checked within the dtype's precision, not to the bit), the backward the input's gradient a
//! row a block and the parameters' sums a channel a block, in a fixed order. Elsewhere
//! [`crate::norm`] composes its normalisation with candle's ops.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::activation::{Activation, Real};
use crate::cpu::row_stats;
use crate::elem::{per_dtype, Elem};
use crate::host;

mod backward;
use backward::{poisoned, Backward, Sums};

/// What the op computes: the statistics (centred or not, over rows or groups) and what follows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spec {
    pub eps: f64,
    /// Subtract the mean (layer and group norm); RMS norm does not.
    pub center: bool,
    /// Group norm of `[N, C, *]` over this many groups; `None`: over the last dimension.
    pub groups: Option<usize>,
    pub act: Option<Activation>,
}

/// Where each value's statistics and affine parameters come from: rows of `cols` values (the
/// last dimension, or one group of `[N, C, *]`: `per_group` channels of `inner` values each).
#[derive(Clone, Copy, Debug)]
struct Geometry {
    cols: usize,
    groups: usize,
    per_group: usize,
    inner: usize,
}

impl Geometry {
    fn of(dims: &[usize], groups: Option<usize>) -> Result<Self> {
        match groups {
            None => {
                let cols = dims.last().copied().unwrap_or(1);
                Ok(Geometry {
                    cols,
                    groups: 1,
                    per_group: cols,
                    inner: 1,
                })
            }
            Some(g) => {
                if dims.len() < 2 || g == 0 || !dims[1].is_multiple_of(g) {
                    bail!("group_norm: {g} groups do not divide the channels of {dims:?}");
                }
                let inner = dims[2..].iter().product::<usize>();
                let per_group = dims[1] / g;
                Ok(Geometry {
                    cols: per_group * inner,
                    groups: g,
                    per_group,
                    inner,
                })
            }
        }
    }

    fn channels(&self) -> usize {
        self.groups * self.per_group
    }

    /// Rows a task: a whole number of rows of about [`host::CHUNK`] values.
    fn rows_a_task(&self) -> usize {
        (host::CHUNK / self.cols.max(1)).max(1)
    }

    /// The first channel of `row`; its `k`-th `inner` values belong to channel `first + k`.
    fn first_channel(&self, row: usize) -> usize {
        (row % self.groups) * self.per_group
    }
}

/// The weight and bias of one channel, as the compute type.
#[derive(Clone, Copy)]
struct Affine<R> {
    w: Option<R>,
    b: Option<R>,
}

impl<R: Real> Affine<R> {
    /// `xhat * w + b`, rounded to `T` after each op as the separate ops store it.
    #[inline(always)]
    fn apply<T: Elem<R = R>>(self, xhat: R) -> R {
        let mut z = xhat;
        if let Some(w) = self.w {
            z = T::round(z.mul(w));
        }
        if let Some(b) = self.b {
            z = T::round(z.add(b));
        }
        z
    }
}

/// The forward over rows starting at `row0`, `act` applied after the affine part. Inlined
/// into [`crate::wide::run`] by its caller, whole: a layer or RMS norm's channel is one value,
/// so a call per channel would be a call per value.
#[inline(always)]
fn forward_rows<T: Elem>(
    spec: Spec,
    geo: Geometry,
    row0: usize,
    x: &[T],
    out: &mut [T],
    (w, b): (Option<&[T]>, Option<&[T]>),
    act: impl Fn(T::R) -> T::R + Copy,
) {
    for (j, (xr, or)) in x
        .chunks(geo.cols.max(1))
        .zip(out.chunks_mut(geo.cols.max(1)))
        .enumerate()
    {
        let (mean, r) = row_stats(xr, spec.center, spec.eps);
        let c0 = geo.first_channel(row0 + j);
        for (k, (xs, os)) in xr
            .chunks(geo.inner.max(1))
            .zip(or.chunks_mut(geo.inner.max(1)))
            .enumerate()
        {
            let c = c0 + k;
            let aff = Affine {
                w: w.map(|w| w[c].load()),
                b: b.map(|b| b[c].load()),
            };
            for (o, v) in os.iter_mut().zip(xs) {
                let xhat = T::from_f64((v.to_f64() - mean) * r).load();
                *o = T::store(act(aff.apply::<T>(xhat)));
            }
        }
    }
}

/// The forward with the activation chosen outside the loops: one loop body per activation,
/// which the compiler vectorises, where a match per value kept the loop scalar (group norm +
/// SiLU at the mid-size UNet's shapes: `examples/time_group_norm`, docs/benchmarks.md).
fn forward<T: Elem>(
    spec: Spec,
    geo: Geometry,
    x: &[T],
    w: Option<&[T]>,
    b: Option<&[T]>,
) -> Vec<T> {
    // A closure per activation, each with its activation as a constant and inlined into the
    // wide loops (a closure left out of line is a call per value, compiled for the baseline).
    macro_rules! with {
        (act $a:expr) => {
            with!(
                #[inline(always)]
                |z| $a.forward(z)
            )
        };
        ($f:expr) => {
            forward_with(spec, geo, x, (w, b), $f)
        };
    }
    match spec.act {
        None => with!(
            #[inline(always)]
            |z| z
        ),
        Some(Activation::Silu) => with!(act Activation::Silu),
        Some(Activation::GeluTanh) => with!(act Activation::GeluTanh),
        Some(Activation::GeluErf) => with!(act Activation::GeluErf),
        Some(Activation::Relu) => with!(act Activation::Relu),
    }
}

fn forward_with<T: Elem>(
    spec: Spec,
    geo: Geometry,
    x: &[T],
    wb: (Option<&[T]>, Option<&[T]>),
    act: impl Fn(T::R) -> T::R + Copy + Sync,
) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    if geo.cols == 0 {
        return out;
    }
    let rows = geo.rows_a_task();
    out.par_chunks_mut(rows * geo.cols)
        .enumerate()
        .for_each(|(t, o)| {
            let at = t * rows * geo.cols;
            let x = &x[at..at + o.len()];
            crate::wide::run(
                #[inline(always)]
                move || forward_rows(spec, geo, t * rows, x, o, wb, act),
            );
        });
    out
}

/// The op: `x` and the weight, with or without the bias (RMS norm has none).
struct NormAffine(Spec);

impl NormAffine {
    fn check(&self, xl: &Layout, params: &[&Layout]) -> Result<Geometry> {
        let geo = Geometry::of(xl.dims(), self.0.groups)?;
        for p in params {
            if p.shape().elem_count() != geo.channels() {
                bail!(
                    "norm: a weight or bias of shape {:?} for {} channels of {:?}",
                    p.dims(),
                    geo.channels(),
                    xl.dims()
                );
            }
        }
        Ok(geo)
    }

    /// The gradients of the input, the weight and (with `b`) the bias.
    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let geo = Geometry::of(x.dims(), self.0.groups)?;
            let rows = cuda_rows(x.layout(), geo);
            let g = g.to_dtype(x.dtype())?.contiguous()?;
            let spec = (self.0.eps, self.0.center);
            return crate::cuda::norm_affine_backward(x, &g, w, b, &rows, spec, self.0.act);
        }
        let wide = |t: &Tensor| t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>();
        let sums = Arc::new(Mutex::new(None));
        let op = Backward {
            spec: self.0,
            w: Some(wide(w)?),
            b: b.map(wide).transpose()?,
            sums: sums.clone(),
        };
        let dx = x.apply_op2_no_bwd(&g.to_dtype(x.dtype())?.contiguous()?, &op)?;
        let Sums { dw, db } = sums
            .lock()
            .map_err(|_| poisoned())?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("norm affine: no sums".into()))?;
        let back = |v: Vec<f64>, like: &Tensor| -> Result<Tensor> {
            Tensor::from_vec(v, like.shape(), like.device())?.to_dtype(like.dtype())
        };
        let db = b.map(|b| back(db, b)).transpose()?;
        Ok((dx, back(dw, w)?, db))
    }
}

impl CustomOp2 for NormAffine {
    fn name(&self) -> &'static str {
        "ft-norm-scale"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let geo = self.check(xl, &[wl])?;
        let spec = self.0;
        let out = per_dtype!("norm", xs, [(xs, xl), (ws, wl)], |x, w| {
            forward(spec, geo, x, Some(w), None)
        });
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let geo = self.check(xl, &[wl])?;
        same_dtypes(&[xs.dtype(), ws.dtype()])?;
        let rows = cuda_rows(xl, geo);
        let spec = (self.0.eps, self.0.center);
        let w = Some((ws, wl));
        let out = crate::cuda::norm_affine_forward((xs, xl), w, None, &rows, spec, self.0.act)?;
        Ok((out, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.grads(x, w, None, g)?;
        Ok((Some(dx), crate::grad_tap::hand_over(w, Some(dw))?))
    }
}

impl CustomOp3 for NormAffine {
    fn name(&self) -> &'static str {
        "ft-norm-affine"
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
        let geo = self.check(xl, &[wl, bl])?;
        let spec = self.0;
        let out = per_dtype!("norm", xs, [(xs, xl), (ws, wl), (bs, bl)], |x, w, b| {
            forward(spec, geo, x, Some(w), Some(b))
        });
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        bs: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let geo = self.check(xl, &[wl, bl])?;
        same_dtypes(&[xs.dtype(), ws.dtype(), bs.dtype()])?;
        let rows = cuda_rows(xl, geo);
        let spec = (self.0.eps, self.0.center);
        let (w, b) = (Some((ws, wl)), Some((bs, bl)));
        let out = crate::cuda::norm_affine_forward((xs, xl), w, b, &rows, spec, self.0.act)?;
        Ok((out, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = self.grads(x, w, Some(b), g)?;
        let tap = crate::grad_tap::hand_over;
        Ok((Some(dx), tap(w, Some(dw))?, tap(b, db)?))
    }
}

/// Whether `x` takes the op, rather than [`crate::norm`]'s composition: on the CPU always, on
/// CUDA where the own kernels run (`crate::has_kernel`). `FT_NORM_OP=0` turns it off, for a
/// before-and-after measurement (as `FT_BATCH_NORM_OP`; the plans' formulas then undercount the
/// tensors the composition keeps).
pub(crate) fn takes(x: &Tensor) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = crate::switched_on(&ON, "FT_NORM_OP");
    on && crate::has_kernel(x)
}

/// The kernel's rows of `l`'s shape in the op's geometry.
#[cfg(feature = "cuda")]
fn cuda_rows(l: &Layout, geo: Geometry) -> crate::cuda::NormRows {
    crate::cuda::NormRows {
        rows: l.shape().elem_count() / geo.cols.max(1),
        cols: geo.cols,
        groups: geo.groups,
        per_group: geo.per_group,
        inner: geo.inner,
    }
}

#[cfg(feature = "cuda")]
fn same_dtypes(d: &[DType]) -> Result<()> {
    if d.iter().any(|t| *t != d[0]) {
        bail!("norm: the input and its parameters differ in dtype ({d:?})");
    }
    Ok(())
}

/// The normalisation of `x`, scaled by `weight`, shifted by `bias` when given, and activated,
/// as one op ([`takes`] must hold). The parameters are cast to `x`'s dtype (a no-op when they
/// are in it, as the models hold them).
pub(crate) fn apply(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    spec: Spec,
) -> Result<Tensor> {
    let x = x.contiguous()?;
    let param = |t: &Tensor| t.to_dtype(x.dtype())?.flatten_all();
    let w = param(weight)?;
    match bias {
        Some(b) => x.apply_op3(&w, &param(b)?, NormAffine(spec)),
        None => x.apply_op2(&w, NormAffine(spec)),
    }
}
