//! The image-by-image path on the CPU (f32 and f64): one image's columns (or a small group's,
//! side by side: [`Geometry::group`]) in a reused buffer, gemm writing straight into that image's
//! output (the bias in it), and the backward's two products per image or group, the weight
//! gradient summed in group order; no input gradient for an input outside the graph.

use std::borrow::Cow;

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

use super::geometry::{ColsAt, Geometry};
use crate::cpu;
pub(super) use crate::gemm_blocks::GemmFloat;
use crate::gemm_blocks::{column_blocks, product as gemm_into, spread_rows, ColumnBlock, Mat};

/// The image-by-image forward: each group of images ([`Geometry::group`]; one image unless they
/// are small) unfolded side by side into one reused buffer and multiplied by the weight; a lone
/// image's product goes straight into its [O, Ho*Wo] output, which starts as the bias, a group's
/// into a scratch [O, G*Ho*Wo] that starts as the bias and is split into the images' outputs.
/// The bias is a channel's ([O]) or each image's own ([B, O] as B*O values: a UNet block's
/// convolution bias plus its time embedding).
fn forward_by_image<T: GemmFloat>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    g: &Geometry,
    o: usize,
) -> Result<Vec<T>> {
    let (l, ck) = g.cols();
    let group = g.group();
    let mut out = vec![T::zero(); g.b * o * l];
    // Group `gi`'s outputs `y` ([n, O, L]) with its column buffer and product scratch.
    let images = |gi: usize, y: &mut [T], bufs: &mut (Vec<T>, Vec<T>), threads: bool| {
        let (cols, scratch) = bufs;
        let n = y.len() / (o * l).max(1);
        let gl = n * l;
        for i in 0..n {
            let at = ColsAt {
                stride: gl,
                offset: i * l,
                threads,
            };
            g.image_columns(x, gi * group + i, 0..ck, cols, at);
        }
        let (lhs, rhs) = (Mat::new(w, false), Mat::new(&cols[..ck * gl], false));
        // Image `i`'s bias for channel `oi`: a channel's, or an image's own ([B, O]).
        let bias_of = |b: &[T], i: usize, oi: usize| match b.len() == o {
            true => b[oi],
            false => b[(gi * group + i) * o + oi],
        };
        if n == 1 {
            if let Some(b) = bias {
                for (oi, row) in y.chunks_mut(l.max(1)).enumerate() {
                    row.fill(bias_of(b, 0, oi));
                }
            }
            return gemm_into(y, lhs, rhs, o, l, ck, bias.is_some(), threads);
        }
        let scratch = &mut scratch[..o * gl];
        if let Some(b) = bias {
            for (oi, row) in scratch.chunks_mut(gl).enumerate() {
                for (i, part) in row.chunks_mut(l.max(1)).enumerate() {
                    part.fill(bias_of(b, i, oi));
                }
            }
        }
        gemm_into(scratch, lhs, rhs, o, gl, ck, bias.is_some(), threads)?;
        for (i, yi) in y.chunks_mut(o * l).enumerate() {
            for (oi, row) in yi.chunks_mut(l).enumerate() {
                row.copy_from_slice(&scratch[oi * gl + i * l..][..l]);
            }
        }
        Ok(())
    };
    let bufs = || {
        let scratch = if group > 1 { o * group * l } else { 0 };
        (vec![T::zero(); ck * group * l], vec![T::zero(); scratch])
    };
    let chunk = (group * o * l).max(1);
    if g.images_in_parallel(o) {
        use rayon::prelude::*;
        out.par_chunks_mut(chunk)
            .enumerate()
            .try_for_each_init(bufs, |b, (gi, y)| images(gi, y, b, false))?;
    } else {
        let mut b = bufs();
        for (gi, y) in out.chunks_mut(chunk).enumerate() {
            images(gi, y, &mut b, true)?;
        }
    }
    Ok(out)
}

/// [`forward_by_image`] on CPU storages: input, weight and bias (when given) all f32 or all
/// f64; `None` for other dtypes, which the callers handle (or refuse) themselves.
pub(super) fn forward_storage(
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    bias: Option<(&CpuStorage, &Layout)>,
    g: &Geometry,
    o: usize,
) -> Result<Option<CpuStorage>> {
    fn run<T: GemmFloat>(
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
        g: &Geometry,
        o: usize,
    ) -> Result<Vec<T>> {
        let bias = match bias {
            Some((s, l)) => Some(cpu::slice(s.as_slice::<T>()?, l)?),
            None => None,
        };
        let (xs, ws) = (x.0.as_slice::<T>()?, w.0.as_slice::<T>()?);
        forward_by_image(cpu::slice(xs, x.1)?, cpu::slice(ws, w.1)?, bias, g, o)
    }
    // The storage's dtype where it is one the image-by-image path takes.
    let float = |s: &CpuStorage| match s {
        CpuStorage::F32(_) => Some(DType::F32),
        CpuStorage::F64(_) => Some(DType::F64),
        _ => None,
    };
    let same = |d: DType| {
        float(x.0) == Some(d)
            && float(w.0) == Some(d)
            && bias.is_none_or(|(b, _)| float(b) == Some(d))
    };
    Ok(if same(DType::F32) {
        Some(CpuStorage::F32(run::<f32>(x, w, bias, g, o)?))
    } else if same(DType::F64) {
        Some(CpuStorage::F64(run::<f64>(x, w, bias, g, o)?))
    } else {
        None
    })
}

/// The output gradient `dy` ([B, O, L]) with each group's images ([`Geometry::group`]) side by
/// side: group `gi`'s block, at the same offset as in `dy` (`gi * group * O * L`), is one
/// [O, n*L] matrix, image `i`'s rows at columns `i*L..`. `dy` itself when the groups are single
/// images. Laid out once for the backward's two products: the weight gradient's parts each laid
/// out every group again (up to [`super::geometry::PARTS`] copies of `dy`, 2.5% of ResNet10's
/// backward samples at 84 px).
fn side_by_side<'a, T: Copy>(dy: &'a [T], g: &Geometry, o: usize) -> Cow<'a, [T]> {
    let (l, group) = (g.cols().0, g.group());
    if group <= 1 || dy.is_empty() || l == 0 || o == 0 {
        return Cow::Borrowed(dy);
    }
    // Row `oi` of each image in turn, group by group: every value written once, in order.
    let mut out = Vec::with_capacity(dy.len());
    for from in dy.chunks(group * o * l) {
        let n = from.len() / (o * l);
        for oi in 0..o {
            for i in 0..n {
                out.extend_from_slice(&from[(i * o + oi) * l..][..l]);
            }
        }
    }
    Cow::Owned(out)
}

/// What the image-by-image backward gives: the input (when asked for), weight and (with a bias)
/// bias gradients.
struct ConvGrads<T> {
    dx: Option<Vec<T>>,
    dw: Vec<T>,
    db: Option<Vec<T>>,
}

/// The image-by-image backward of `x` [B, C, H, W], `w` [O, C*k*k] and the output gradient `dy`
/// [B, O, Ho*Wo]: the bias gradient (summed in f64, per channel with the images in order, or per
/// image for a [B, O] bias of `bias_len` B*O values) when there is a bias; the input gradient only `with_dx` (a network's first layer reads images, which
/// need none: its two products per image and the folding were a third of that layer's
/// backward), a group of images ([`Geometry::group`]) at a time, the groups on rayon's threads
/// when [`Geometry::images_in_parallel`]; the weight gradient by [`weight_grad`].
#[allow(clippy::too_many_arguments)]
fn backward_by_image<T: GemmFloat>(
    x: &[T],
    w: &[T],
    dy: &[T],
    g: &Geometry,
    o: usize,
    bias_len: Option<usize>,
    with_dx: bool,
) -> Result<ConvGrads<T>> {
    let (l, ck) = g.cols();
    let group = g.group();
    let chw = g.c * g.h * g.w;
    let mut dx = vec![T::zero(); if with_dx { g.b * chw } else { 0 }];
    let mut db = vec![0f64; bias_len.unwrap_or(0)];
    if let Some(n) = bias_len {
        // A channel's sum over the images in order, or each image's own.
        let per_image = n != o;
        for (img, dyb) in dy.chunks((o * l).max(1)).take(g.b).enumerate() {
            let sums = &mut db[if per_image { img * o } else { 0 }..][..o];
            for (sum, row) in sums.iter_mut().zip(dyb.chunks(l.max(1))) {
                *sum += row.iter().map(|v| v.to_f64()).sum::<f64>();
            }
        }
    }
    let images_in = |gi: usize| group.min(g.b - gi * group);
    let dy = side_by_side(dy, g, o);
    let dy = &dy[..];
    // dcols [CK, n L] = W^T [CK, O] x dY_group [O, n L], folded onto each image's input.
    let input_grad = |gi: usize, dxg: &mut [T], dcols: &mut Vec<T>, threads: bool| {
        let n = images_in(gi);
        let gl = n * l;
        dcols.resize(ck * gl, T::zero());
        let rhs = &dy[gi * group * o * l..][..n * o * l];
        let (lhs, rhs) = (Mat::new(w, true), Mat::new(rhs, false));
        gemm_into(dcols, lhs, rhs, ck, gl, o, false, threads)?;
        for (i, dxb) in dxg.chunks_mut(chw.max(1)).enumerate() {
            let at = ColsAt {
                stride: gl,
                offset: i * l,
                threads,
            };
            g.fold_image(dcols, dxb, at);
        }
        Ok::<_, candle_core::Error>(())
    };
    let chunk = (group * chw).max(1);
    if with_dx && g.images_in_parallel(o) {
        use rayon::prelude::*;
        dx.par_chunks_mut(chunk)
            .enumerate()
            .try_for_each_init(Vec::new, |b, (gi, dxg)| input_grad(gi, dxg, b, false))?;
    } else if with_dx {
        let mut dcols = Vec::new();
        for (gi, dxg) in dx.chunks_mut(chunk).enumerate() {
            input_grad(gi, dxg, &mut dcols, true)?;
        }
    }
    let dw = weight_grad(x, dy, g, o)?;
    Ok(ConvGrads {
        dx: with_dx.then_some(dx),
        dw,
        db: bias_len.map(|_| db.into_iter().map(T::from_f64).collect()),
    })
}

/// The weight gradient dW [O, C*k*k] = sum over the groups of images, in order, of
/// dY_group [O, n L] x cols_group^T [n L, C*k*k], its columns (the columns' rows: a channel and
/// kernel tap each) in parts of [`Geometry::part_rows`], each part on one of rayon's threads
/// unfolding only its own rows of each image: one unfolding in all, and products on one
/// thread each (gemm's own threads ran most of these shapes at half speed:
/// [`super::geometry::TASK_MACS`]). With fewer parts than threads (a first layer's 27 rows make
/// one) each part's unfolding and product take the threads instead. gemm does not split a
/// product's sums over its threads and the parts come from the shape alone, so the sums do not
/// depend on the threads. Each part writes its columns of dW in place
/// ([`crate::gemm_blocks::column_blocks`]): assembling parts of their own into a new matrix
/// was 5% of the UNet bench's step at 256 px, most of it page faults and the copy. `dy` comes
/// with its groups side by side ([`side_by_side`]).
fn weight_grad<T: GemmFloat>(x: &[T], dy: &[T], g: &Geometry, o: usize) -> Result<Vec<T>> {
    let (l, ck) = g.cols();
    let group = g.group();
    let rows = g.part_rows();
    let threads = ck.div_ceil(rows) < rayon::current_num_threads();
    let mut dw = vec![T::zero(); o * ck];
    // Part `p`: dW[:, p rows..] (+)= dY_group [O, n L] x cols_part^T [n L, r], each group in
    // order, written in place (`column_blocks`).
    let part = |cols: &mut Vec<T>, p: usize, mut dw: ColumnBlock<'_, T>| {
        let (first, r) = (p * rows, dw.width());
        for gi in 0..g.groups() {
            let n = group.min(g.b - gi * group);
            let gl = n * l;
            // The part's rows an odd number of cache lines apart: gemm gathers across them.
            let ld = spread_rows::<T>(gl);
            cols.resize(r * ld, T::zero());
            for i in 0..n {
                let at = ColsAt {
                    stride: ld,
                    offset: i * l,
                    threads,
                };
                g.image_columns(x, gi * group + i, first..first + r, cols, at);
            }
            let lhs = &dy[gi * group * o * l..][..n * o * l];
            let rhs = Mat::rows_apart(&cols[..r * ld], true, ld);
            let lhs = Mat::new(lhs, false);
            dw.product(lhs, rhs, gl, gi > 0, threads)?;
        }
        Ok(())
    };
    column_blocks(&mut dw, (o, ck), rows, Default::default, part)?;
    Ok(dw)
}

/// [`backward_by_image`] on tensors (f32 or f64, on the CPU), read in place: (dx, dw, db), dx
/// `None` when `x` is not part of a graph (`Tensor::track_op`: no gradient of it is kept).
pub(super) fn backward_tensors(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    dy: &Tensor,
    g: &Geometry,
    o: usize,
) -> Result<(Option<Tensor>, Tensor, Option<Tensor>)> {
    fn run<T: GemmFloat>(
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        dy: &Tensor,
        g: &Geometry,
        o: usize,
    ) -> Result<(Option<Tensor>, Tensor, Option<Tensor>)> {
        // Each made contiguous first (a no-op for the op's own inputs), then read in place.
        let (x_, w_, dy_) = (
            x.contiguous()?,
            w.contiguous()?,
            dy.to_dtype(x.dtype())?.contiguous()?,
        );
        let grads = crate::host::with_slice(&x_, |xs| {
            crate::host::with_slice(&w_, |ws| {
                crate::host::with_slice(&dy_, |ds| {
                    let bias_len = bias.map(|b| b.elem_count());
                    backward_by_image::<T>(xs, ws, ds, g, o, bias_len, x.track_op())
                })
            })
        })
        .flatten()
        .flatten()
        .ok_or_else(|| {
            candle_core::Error::Msg("conv2d backward: tensors not on the CPU".into())
        })??;
        let db = match bias {
            Some(b) => crate::host::shaped_like(grads.db, b)?,
            None => None,
        };
        let dx = crate::host::shaped_like(grads.dx, x)?;
        Ok((dx, Tensor::from_vec(grads.dw, w.shape(), w.device())?, db))
    }
    match x.dtype() {
        DType::F32 => run::<f32>(x, w, bias, dy, g, o),
        DType::F64 => run::<f64>(x, w, bias, dy, g, o),
        d => candle_core::bail!("conv2d backward by image: {d:?} (f32 or f64)"),
    }
}
