//! The image-by-image path on the CPU (f32 and f64): one image's columns in a reused buffer,
//! gemm writing straight into that image's output (the bias in it), and the backward's two
//! products per image, the weight gradient summed in image order.

use candle_core::{CpuStorage, DType, Layout, Result, Tensor, WithDType};

use super::geometry::Geometry;
use crate::cpu;

/// A float the image-by-image path multiplies with gemm: f32 and f64.
pub(super) trait GemmFloat: WithDType + Send + Sync {}
impl GemmFloat for f32 {}
impl GemmFloat for f64 {}

/// A row-major matrix operand: its values and whether they hold it transposed (the row-major
/// storage of its transpose).
struct Mat<'a, T> {
    data: &'a [T],
    transposed: bool,
}

/// `dst` (m x n, row-major) = `lhs` (m x k) x `rhs` (k x n), or `dst +=` it with `accumulate`;
/// on gemm's threads when the product is large and `threads` allows it (not when the caller
/// already runs on rayon's threads, one image each). Lengths are checked before gemm reads them.
#[allow(clippy::too_many_arguments)]
fn gemm_into<T: GemmFloat>(
    dst: &mut [T],
    lhs: Mat<T>,
    rhs: Mat<T>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    threads: bool,
) -> Result<()> {
    if dst.len() < m * n || lhs.data.len() < m * k || rhs.data.len() < k * n {
        candle_core::bail!(
            "conv2d: a {m}x{k} by {k}x{n} product with {}, {} and {} values",
            lhs.data.len(),
            rhs.data.len(),
            dst.len()
        );
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    // (row stride, column stride) of each operand.
    let (lrs, lcs) = if lhs.transposed { (1, m) } else { (k, 1) };
    let (rrs, rcs) = if rhs.transposed { (1, k) } else { (n, 1) };
    let parallelism = if threads && m * n * k >= 1 << 18 && rayon::current_num_threads() > 1 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the three slices hold at least the m x n, m x k and k x n values the strides above
    // address (checked above); `dst` is borrowed mutably and does not alias the operands.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lcs as isize,
            lrs as isize,
            rhs.data.as_ptr(),
            rcs as isize,
            rrs as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

/// The image-by-image forward: each image's columns into one reused buffer, multiplied by the
/// weight straight into its [O, Ho*Wo] output, which starts as the bias where there is one.
fn forward_by_image<T: GemmFloat>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    g: &Geometry,
    o: usize,
) -> Result<Vec<T>> {
    let (l, ck) = g.cols();
    let mut out = vec![T::zero(); g.b * o * l];
    let image = |bi: usize, y: &mut [T], cols: &mut [T], threads: bool| {
        if let Some(b) = bias {
            for (row, v) in y.chunks_mut(l.max(1)).zip(b) {
                row.fill(*v);
            }
        }
        g.image_columns(x, bi, cols);
        let (lhs, rhs) = (
            Mat {
                data: w,
                transposed: false,
            },
            Mat {
                data: cols,
                transposed: false,
            },
        );
        gemm_into(y, lhs, rhs, o, l, ck, bias.is_some(), threads)
    };
    if g.images_in_parallel() {
        use rayon::prelude::*;
        out.par_chunks_mut((o * l).max(1))
            .enumerate()
            .take(g.b)
            .try_for_each_init(
                || vec![T::zero(); ck * l],
                |cols, (bi, y)| image(bi, y, cols, false),
            )?;
    } else {
        let mut cols = vec![T::zero(); ck * l];
        for (bi, y) in out.chunks_mut((o * l).max(1)).enumerate().take(g.b) {
            image(bi, y, &mut cols, true)?;
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

/// What the image-by-image backward gives: the input, weight and (with a bias) bias gradients.
struct ConvGrads<T> {
    dx: Vec<T>,
    dw: Vec<T>,
    db: Option<Vec<T>>,
}

/// The image-by-image backward of `x` [B, C, H, W], `w` [O, C*k*k] and the output gradient `dy`
/// [B, O, Ho*Wo], images in order; the bias gradient (per channel, summed in f64) when
/// `with_bias`.
fn backward_by_image<T: GemmFloat>(
    x: &[T],
    w: &[T],
    dy: &[T],
    g: &Geometry,
    o: usize,
    with_bias: bool,
) -> Result<ConvGrads<T>> {
    let (l, ck) = g.cols();
    let chw = g.c * g.h * g.w;
    let mut dx = vec![T::zero(); g.b * chw];
    let mut dw = vec![T::zero(); o * ck];
    let mut db = vec![0f64; if with_bias { o } else { 0 }];
    let parallel = g.images_in_parallel();
    let mut cols = vec![T::zero(); ck * l];
    // dcols_b [CK, L] = W^T [CK, O] x dY_b [O, L], folded onto image b's input: images apart.
    let input_grad = |bi: usize, dxb: &mut [T], dcols: &mut [T], threads: bool| {
        let (lhs, rhs) = (
            Mat {
                data: w,
                transposed: true,
            },
            Mat {
                data: &dy[bi * o * l..][..o * l],
                transposed: false,
            },
        );
        gemm_into(dcols, lhs, rhs, ck, l, o, false, threads)?;
        g.fold_image(dcols, dxb);
        Ok::<_, candle_core::Error>(())
    };
    if parallel {
        use rayon::prelude::*;
        dx.par_chunks_mut(chw.max(1))
            .enumerate()
            .take(g.b)
            .try_for_each_init(
                || vec![T::zero(); ck * l],
                |dcols, (bi, dxb)| input_grad(bi, dxb, dcols, false),
            )?;
    }
    let mut dcols = if parallel {
        Vec::new()
    } else {
        vec![T::zero(); ck * l]
    };
    for bi in 0..g.b {
        let dyb = &dy[bi * o * l..][..o * l];
        for (sum, row) in db.iter_mut().zip(dyb.chunks(l.max(1))) {
            *sum += row.iter().map(|v| v.to_f64()).sum::<f64>();
        }
        g.image_columns(x, bi, &mut cols);
        // dW += dY_b [O, L] x cols_b^T [L, CK], images in order.
        let (lhs, rhs) = (
            Mat {
                data: dyb,
                transposed: false,
            },
            Mat {
                data: &cols,
                transposed: true,
            },
        );
        gemm_into(&mut dw, lhs, rhs, o, ck, l, bi > 0, true)?;
        if !parallel {
            input_grad(bi, &mut dx[bi * chw..][..chw], &mut dcols, true)?;
        }
    }
    Ok(ConvGrads {
        dx,
        dw,
        db: with_bias.then(|| db.into_iter().map(T::from_f64).collect()),
    })
}

/// [`backward_by_image`] on tensors (f32 or f64, on the CPU), read in place: (dx, dw, db).
pub(super) fn backward_tensors(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    dy: &Tensor,
    g: &Geometry,
    o: usize,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    fn run<T: GemmFloat>(
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        dy: &Tensor,
        g: &Geometry,
        o: usize,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        // Each made contiguous first (a no-op for the op's own inputs), then read in place.
        let (x_, w_, dy_) = (
            x.contiguous()?,
            w.contiguous()?,
            dy.to_dtype(x.dtype())?.contiguous()?,
        );
        let grads = crate::host::with_slice(&x_, |xs| {
            crate::host::with_slice(&w_, |ws| {
                crate::host::with_slice(&dy_, |ds| {
                    backward_by_image::<T>(xs, ws, ds, g, o, bias.is_some())
                })
            })
        })
        .flatten()
        .flatten()
        .ok_or_else(|| {
            candle_core::Error::Msg("conv2d backward: tensors not on the CPU".into())
        })??;
        let db = match (grads.db, bias) {
            (Some(db), Some(b)) => Some(Tensor::from_vec(db, b.shape(), b.device())?),
            _ => None,
        };
        Ok((
            Tensor::from_vec(grads.dx, x.shape(), x.device())?,
            Tensor::from_vec(grads.dw, w.shape(), w.device())?,
            db,
        ))
    }
    match x.dtype() {
        DType::F32 => run::<f32>(x, w, bias, dy, g, o),
        DType::F64 => run::<f64>(x, w, bias, dy, g, o),
        d => candle_core::bail!("conv2d backward by image: {d:?} (f32 or f64)"),
    }
}
