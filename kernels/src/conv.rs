//! 2-D convolution as im2col + matrix products, with a backward of two matrix products and a
//! col2im, and nothing saved but the op's inputs.
//!
//! candle 0.11.1's CPU conv2d backward takes its direct (per-output dot product) route for the
//! input gradient and costs 6-7x its own forward (`cargo run -p ft-kernels --example conv_bench`),
//! which made it most of a UNet step on CPU. Here, in f32 and f64, each image is unfolded into
//! columns [C k k, Ho Wo] (a buffer of one image, reused for the next) and multiplied by the
//! [O, C k k] weight straight into its [O, Ho Wo] output; the backward unfolds again (the columns
//! are recomputed, not kept: they are k*k times the input), accumulates the weight gradient
//! image by image into one [O, C k k] matrix and folds each image's column gradient back (summed
//! in f64). The unfolding runs over the columns' rows and the folding over the channels on
//! rayon's threads, the products on gemm's; images go in order, so the sums do not depend on
//! the threads. Where an image's columns are small (a UNet's 8 x 8 latents), splitting one
//! image costs more than it gains: the images then go on rayon's threads, one each, for the
//! forward and the input gradient, and the weight gradient still sums them in order. Nothing of the size of all the images' columns is ever made (at 84 px, Conv4's
//! second layer: 345 MB of columns, and as many again of their gradient in f64 twice over, each
//! a fresh allocation the kernel zeroed page by page). bf16 and f16 unfold all images and take
//! candle's matmul. Other devices use candle's conv2d (cuDNN or its im2col kernel on CUDA).

use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

use crate::cpu;

/// Geometry of one convolution: square kernel, equal stride and padding on both axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    b: usize,
    c: usize,
    h: usize,
    w: usize,
    k: usize,
    stride: usize,
    pad: usize,
}

impl Geometry {
    fn new(dims: &[usize], k: usize, stride: usize, pad: usize) -> Result<Self> {
        let [b, c, h, w] = dims else {
            candle_core::bail!("conv2d expects [N, C, H, W], got {dims:?}");
        };
        if k == 0 || stride == 0 || h + 2 * pad < k || w + 2 * pad < k {
            candle_core::bail!(
                "conv2d: kernel {k} stride {stride} padding {pad} do not fit input {h}x{w}"
            );
        }
        Ok(Geometry {
            b: *b,
            c: *c,
            h: *h,
            w: *w,
            k,
            stride,
            pad,
        })
    }

    fn out_hw(&self) -> (usize, usize) {
        (
            (self.h + 2 * self.pad - self.k) / self.stride + 1,
            (self.w + 2 * self.pad - self.k) / self.stride + 1,
        )
    }

    /// Columns per image (output positions) and column length (C k k).
    fn cols(&self) -> (usize, usize) {
        let (oh, ow) = self.out_hw();
        (oh * ow, self.c * self.k * self.k)
    }

    /// Whether the images go on rayon's threads, one each (each with its own column buffer and
    /// gemm on one thread): when an image's columns are too few for its unfolding, folding and
    /// product to be worth splitting ([`PAR_ELEMS`]) and there are images and threads to share.
    /// Each image's values are computed as on one thread, so the result does not change.
    fn images_in_parallel(&self) -> bool {
        let (l, ck) = self.cols();
        ck * l < PAR_ELEMS && self.b > 1 && rayon::current_num_threads() > 1
    }

    /// Calls `f(column index within the image, offset in the column, input offset)` for every
    /// in-bounds (output position, kernel tap) pair of image `bi`.
    fn for_each_tap(&self, bi: usize, mut f: impl FnMut(usize, usize, usize)) {
        let (oh, ow) = self.out_hw();
        let (k, s, p) = (self.k, self.stride, self.pad as isize);
        for ci in 0..self.c {
            let plane = (bi * self.c + ci) * self.h * self.w;
            for ky in 0..k {
                for kx in 0..k {
                    let j = (ci * k + ky) * k + kx;
                    for oy in 0..oh {
                        let y = (oy * s) as isize + ky as isize - p;
                        if y < 0 || y >= self.h as isize {
                            continue;
                        }
                        let row = plane + y as usize * self.w;
                        for ox in 0..ow {
                            let x = (ox * s) as isize + kx as isize - p;
                            if x < 0 || x >= self.w as isize {
                                continue;
                            }
                            f(oy * ow + ox, j, row + x as usize);
                        }
                    }
                }
            }
        }
    }

    /// [B, C, H, W] (contiguous) to [B, Ho*Wo, C*k*k], zeros where the kernel hangs over the edge.
    fn im2col<T: WithDType>(&self, x: &[T]) -> Vec<T> {
        let (l, ck) = self.cols();
        let mut out = vec![T::zero(); self.b * l * ck];
        for bi in 0..self.b {
            let o = &mut out[bi * l * ck..(bi + 1) * l * ck];
            self.for_each_tap(bi, |col, j, src| o[col * ck + j] = x[src]);
        }
        out
    }

    /// Image `bi` of `x` (contiguous [B, C, H, W]) as columns [C*k*k, Ho*Wo] in `cols`, zeros where
    /// the kernel hangs over the edge: each row (a channel and kernel tap) on its own, on rayon's
    /// threads when the image is large.
    fn image_columns<T: WithDType>(&self, x: &[T], bi: usize, cols: &mut [T]) {
        let (oh, ow) = self.out_hw();
        let l = oh * ow;
        let (k, s, p) = (self.k, self.stride, self.pad as isize);
        let fill = |j: usize, row: &mut [T]| {
            let (ci, tap) = (j / (k * k), j % (k * k));
            let (ky, kx) = (tap / k, tap % k);
            let plane = &x[(bi * self.c + ci) * self.h * self.w..][..self.h * self.w];
            for oy in 0..oh {
                let out = &mut row[oy * ow..(oy + 1) * ow];
                let y = (oy * s) as isize + ky as isize - p;
                if y < 0 || y >= self.h as isize {
                    out.fill(T::zero());
                    continue;
                }
                let src = &plane[y as usize * self.w..][..self.w];
                for (ox, o) in out.iter_mut().enumerate() {
                    let x = (ox * s) as isize + kx as isize - p;
                    *o = if x < 0 || x >= self.w as isize {
                        T::zero()
                    } else {
                        src[x as usize]
                    };
                }
            }
        };
        let rows = cols[..self.c * k * k * l].chunks_mut(l.max(1));
        if self.c * k * k * l >= PAR_ELEMS {
            use rayon::prelude::*;
            cols[..self.c * k * k * l]
                .par_chunks_mut(l.max(1))
                .enumerate()
                .for_each(|(j, row)| fill(j, row));
        } else {
            rows.enumerate().for_each(|(j, row)| fill(j, row));
        }
    }

    /// The adjoint of [`Self::image_columns`]: the column gradient `dcols` [C*k*k, Ho*Wo] of image
    /// `bi` summed back onto its input positions in `dx` ([C, H, W] of that image), in f64, each
    /// channel on its own (on rayon's threads when the image is large).
    fn fold_image<T: WithDType>(&self, dcols: &[T], dx: &mut [T]) {
        let (oh, ow) = self.out_hw();
        let l = oh * ow;
        let (k, s, p) = (self.k, self.stride, self.pad as isize);
        let hw = self.h * self.w;
        let fold = |ci: usize, out: &mut [T]| {
            let mut acc = vec![0f64; hw];
            for tap in 0..k * k {
                let (ky, kx) = (tap / k, tap % k);
                let row = &dcols[(ci * k * k + tap) * l..][..l];
                for oy in 0..oh {
                    let y = (oy * s) as isize + ky as isize - p;
                    if y < 0 || y >= self.h as isize {
                        continue;
                    }
                    let dst = &mut acc[y as usize * self.w..][..self.w];
                    for (ox, g) in row[oy * ow..(oy + 1) * ow].iter().enumerate() {
                        let x = (ox * s) as isize + kx as isize - p;
                        if x >= 0 && x < self.w as isize {
                            dst[x as usize] += g.to_f64();
                        }
                    }
                }
            }
            for (o, a) in out.iter_mut().zip(acc) {
                *o = T::from_f64(a);
            }
        };
        if self.c * k * k * l >= PAR_ELEMS {
            use rayon::prelude::*;
            dx.par_chunks_mut(hw.max(1))
                .enumerate()
                .for_each(|(ci, out)| fold(ci, out));
        } else {
            dx.chunks_mut(hw.max(1))
                .enumerate()
                .for_each(|(ci, out)| fold(ci, out));
        }
    }

    /// The adjoint of `im2col`: sums every column entry back into the input position it came from.
    fn col2im(&self, cols: &[f64]) -> Vec<f64> {
        let (l, ck) = self.cols();
        let mut out = vec![0f64; self.b * self.c * self.h * self.w];
        for bi in 0..self.b {
            let cb = &cols[bi * l * ck..(bi + 1) * l * ck];
            self.for_each_tap(bi, |col, j, dst| out[dst] += cb[col * ck + j]);
        }
        out
    }
}

/// Elements of one image's columns from which its unfolding and folding run on rayon's threads.
const PAR_ELEMS: usize = 1 << 16;

/// A float the image-by-image path multiplies with gemm: f32 and f64.
trait GemmFloat: WithDType + Send + Sync {}
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
fn forward_storage(
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
fn backward_tensors(
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

/// The columns of `x` as a tensor [B, Ho*Wo, C*k*k] (CPU, no gradient).
fn unfold(x: &Tensor, g: &Geometry) -> Result<Tensor> {
    let x = x.detach().contiguous()?;
    let (l, ck) = g.cols();
    fn run<T: WithDType>(x: &Tensor, g: &Geometry, l: usize, ck: usize) -> Result<Tensor> {
        let v: Vec<T> = x.flatten_all()?.to_vec1()?;
        Tensor::from_vec(g.im2col(&v), (g.b, l, ck), x.device())
    }
    match x.dtype() {
        DType::F32 => run::<f32>(&x, g, l, ck),
        DType::F64 => run::<f64>(&x, g, l, ck),
        DType::BF16 => run::<half::bf16>(&x, g, l, ck),
        DType::F16 => run::<half::f16>(&x, g, l, ck),
        d => candle_core::bail!("conv2d: unsupported dtype {d:?}"),
    }
}

#[derive(Debug, Clone, Copy)]
struct Conv2d {
    stride: usize,
    pad: usize,
}

impl Conv2d {
    fn geometry(&self, x: &[usize], w: &[usize]) -> Result<(Geometry, usize)> {
        let [o, c, kh, kw] = w else {
            candle_core::bail!("conv2d weight must be [O, C, k, k], got {w:?}");
        };
        if kh != kw || x.get(1) != Some(c) {
            candle_core::bail!("conv2d: weight {w:?} does not fit input {x:?}");
        }
        Ok((Geometry::new(x, *kh, self.stride, self.pad)?, *o))
    }
}

impl CustomOp2 for Conv2d {
    fn name(&self) -> &'static str {
        "ft-conv2d"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, o) = self.geometry(l1.dims(), l2.dims())?;
        let (oh, ow) = g.out_hw();
        let (l, ck) = g.cols();
        fn run<T: WithDType>(
            x: &[T],
            w: &[T],
            g: &Geometry,
            o: usize,
            l: usize,
            ck: usize,
        ) -> Result<Vec<T>> {
            let dev = candle_core::Device::Cpu;
            let cols = Tensor::from_vec(g.im2col(x), (g.b, l, ck), &dev)?;
            let w = Tensor::from_slice(w, (o, ck), &dev)?;
            // [B, L, CK] x [CK, O] as one 2-D product, then [B, O, L].
            let y = cols.reshape((g.b * l, ck))?.matmul(&w.t()?.contiguous()?)?;
            y.reshape((g.b, l, o))?
                .transpose(1, 2)?
                .contiguous()?
                .flatten_all()?
                .to_vec1()
        }
        if let Some(out) = forward_storage((s1, l1), (s2, l2), None, &g, o)? {
            return Ok((out, Shape::from((g.b, o, oh, ow))));
        }
        let out = match (s1, s2) {
            (CpuStorage::BF16(x), CpuStorage::BF16(w)) => {
                CpuStorage::BF16(run(cpu::slice(x, l1)?, cpu::slice(w, l2)?, &g, o, l, ck)?)
            }
            (CpuStorage::F16(x), CpuStorage::F16(w)) => {
                CpuStorage::F16(run(cpu::slice(x, l1)?, cpu::slice(w, l2)?, &g, o, l, ck)?)
            }
            _ => candle_core::bail!("conv2d: input and weight need the same float dtype"),
        };
        Ok((out, Shape::from((g.b, o, oh, ow))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (g, o) = self.geometry(x.dims(), w.dims())?;
        let (l, ck) = g.cols();
        if matches!(x.dtype(), DType::F32 | DType::F64) {
            let (dx, dw, _) = backward_tensors(x, w, None, dy, &g, o)?;
            return Ok((Some(dx), Some(dw)));
        }
        // dY as [B, L, O]
        let dy = dy
            .detach()
            .reshape((g.b, o, l))?
            .transpose(1, 2)?
            .contiguous()?;
        let w2 = w.detach().reshape((o, ck))?.contiguous()?;
        // dW = sum_b dY_b^T cols_b, as one product over all images: [O, B L] x [B L, CK].
        let cols = unfold(x, &g)?.reshape((g.b * l, ck))?;
        let dyf = dy.reshape((g.b * l, o))?;
        let dw = dyf.t()?.contiguous()?.matmul(&cols)?;
        drop(cols);
        // dCols = dY W, folded back onto the input.
        let dcols: Vec<f64> = dyf
            .matmul(&w2)?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1()?;
        let dx = Tensor::from_vec(g.col2im(&dcols), x.shape(), x.device())?.to_dtype(x.dtype())?;
        Ok((Some(dx), Some(dw.reshape(w.shape())?)))
    }
}

/// The convolution with its bias added in the same op (CPU, f32 and f64): no second map of the
/// output's size, and the bias gradient summed from the output gradient the backward reads
/// anyway (as a broadcast add, candle summed it over three non-last dimensions on one thread).
#[derive(Debug, Clone, Copy)]
struct Conv2dBias(Conv2d);

impl CustomOp3 for Conv2dBias {
    fn name(&self) -> &'static str {
        "ft-conv2d-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, o) = self.0.geometry(l1.dims(), l2.dims())?;
        if l3.dims() != [o] {
            candle_core::bail!("conv2d: a bias of {:?} for {o} channels", l3.dims());
        }
        let (oh, ow) = g.out_hw();
        let Some(out) = forward_storage((s1, l1), (s2, l2), Some((s3, l3)), &g, o)? else {
            candle_core::bail!("conv2d with bias: f32 or f64, the same for all three")
        };
        Ok((out, Shape::from((g.b, o, oh, ow))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (g, o) = self.0.geometry(x.dims(), w.dims())?;
        let (dx, dw, db) = backward_tensors(x, w, Some(b), dy, &g, o)?;
        Ok((Some(dx), Some(dw), db))
    }
}

/// Whether `conv2d` adds a bias inside the convolution op (the CPU in f32 and f64) rather than
/// as a broadcast add after it: the activation formulas count one map less then.
pub fn bias_in_op(device: &candle_core::Device, dtype: DType) -> bool {
    device.is_cpu() && matches!(dtype, DType::F32 | DType::F64)
}

/// `conv2d(x, weight) + bias` for x [N, C, H, W], weight [O, C, k, k], bias [O], with equal
/// stride and padding on both axes (what every model in this workspace uses).
pub fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: usize,
    padding: usize,
) -> Result<Tensor> {
    let op = Conv2d {
        stride,
        pad: padding,
    };
    if let Some(b) = bias {
        if bias_in_op(x.device(), x.dtype()) && b.dtype() == x.dtype() {
            return x.contiguous()?.apply_op3(
                &weight.contiguous()?,
                &b.contiguous()?,
                Conv2dBias(op),
            );
        }
    }
    let y = if x.device().is_cpu() {
        x.contiguous()?.apply_op2(&weight.contiguous()?, op)
    } else {
        x.conv2d(weight, padding, stride, 1, 1)
    };
    let y = y?;
    match bias {
        Some(b) => y.broadcast_add(&b.reshape((1, (), 1, 1))?),
        None => Ok(y),
    }
}
