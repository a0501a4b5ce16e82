//! Max and average pooling over [N, C, H, W] with any kernel and stride, PyTorch's floor mode
//! (out = (H - k) / s + 1, no padding), and a correct backward.
//!
//! candle's `max_pool2d` backward scales the gradient by 1/k^2 and errors for kernel != stride;
//! its `avg_pool2d` is wrong for odd inputs. Both passes here read the CPU storage in its dtype
//! (comparing and summing in f64 per window, planes in parallel) and write the result once: the
//! gradient goes to the first maximum of each window, as in PyTorch, or is spread evenly for
//! average pooling, checked against finite differences.
//! On CUDA both passes are kernels (`crate::cuda`), tested against this CPU version.

use crate::cpu::gather;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;

use crate::cpu;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Max,
    Avg,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Pool {
    kind: Kind,
    kernel: (usize, usize),
    stride: (usize, usize),
}

/// One thread's buffers for [`Pool::plane_backward`].
pub(crate) struct PlaneScratch<T> {
    /// Overlapping windows' sums, a plane's (empty for disjoint windows).
    acc: Vec<f64>,
    /// The forward's outputs and, for max pooling, their sources.
    out: Vec<T>,
    arg: Vec<usize>,
}

impl Pool {
    /// Max pooling with `kernel` and `stride`.
    pub(crate) fn max(kernel: (usize, usize), stride: (usize, usize)) -> Self {
        Pool {
            kind: Kind::Max,
            kernel,
            stride,
        }
    }

    /// Whether windows overlap (their gradients then add up).
    fn overlaps(&self) -> bool {
        self.stride.0 < self.kernel.0 || self.stride.1 < self.kernel.1
    }

    /// Buffers for [`Self::plane_backward`] over `h` x `w` planes (`out_hw` checked).
    pub(crate) fn scratch<T: WithDType>(&self, h: usize, w: usize) -> PlaneScratch<T> {
        let (kh, kw) = self.kernel;
        let (sh, sw) = self.stride;
        let outs = ((h - kh) / sh + 1) * ((w - kw) / sw + 1);
        PlaneScratch {
            acc: vec![0f64; if self.overlaps() { h * w } else { 0 }],
            out: vec![T::zero(); outs],
            arg: vec![0usize; outs],
        }
    }

    #[cfg(feature = "cuda")]
    fn spec(&self) -> crate::cuda::PoolSpec {
        crate::cuda::PoolSpec {
            kind: match self.kind {
                Kind::Max => 0,
                Kind::Avg => 1,
            },
            kernel: self.kernel,
            stride: self.stride,
        }
    }

    pub(crate) fn out_hw(&self, h: usize, w: usize) -> Result<(usize, usize)> {
        let (kh, kw) = self.kernel;
        let (sh, sw) = self.stride;
        if kh == 0 || kw == 0 || sh == 0 || sw == 0 || kh > h || kw > w {
            candle_core::bail!(
                "pool: kernel {:?} stride {:?} do not fit input {h}x{w}",
                self.kernel,
                self.stride
            );
        }
        Ok(((h - kh) / sh + 1, (w - kw) / sw + 1))
    }

    /// Forward on one [H, W] plane of width `w` into `out` (`oh * ow` outputs); `arg` receives
    /// the plane index of each output's source (max) when given. Max compares in the dtype
    /// itself (exact); average sums in f64 and rounds once.
    pub(crate) fn plane<T: WithDType>(
        &self,
        x: &[T],
        w: usize,
        out: &mut [T],
        arg: Option<&mut [usize]>,
    ) {
        let (kh, kw) = self.kernel;
        let (sh, sw) = self.stride;
        let ow = (w - kw) / sw + 1;
        match self.kind {
            Kind::Max if (kh, kw, sh, sw) == (2, 2, 2, 2) => max_2x2(x, w, out, arg),
            Kind::Max => crate::wide::run(
                #[inline(always)]
                move || match sw {
                    2 => max_rows(x, w, (kh, kw), (sh, 2), out, arg),
                    _ => max_rows(x, w, (kh, kw), (sh, sw), out, arg),
                },
            ),
            Kind::Avg => {
                let area = (kh * kw) as f64;
                for (oy, row) in out.chunks_mut(ow).enumerate() {
                    for (ox, y) in row.iter_mut().enumerate() {
                        let first = oy * sh * w + ox * sw;
                        let sum: f64 = (0..kh)
                            .flat_map(|dy| &x[first + dy * w..first + dy * w + kw])
                            .map(|v| v.to_f64())
                            .sum();
                        *y = T::from_f64(sum / area);
                    }
                }
            }
        }
    }

    /// The forward over all planes, in the input's dtype, planes in parallel.
    fn forward<T: WithDType>(&self, x: &[T], dims: (usize, usize, usize, usize)) -> Result<Vec<T>> {
        let (n, c, h, w) = dims;
        let (oh, ow) = self.out_hw(h, w)?;
        let mut out = vec![T::zero(); n * c * oh * ow];
        out.par_chunks_mut(oh * ow)
            .zip(x.par_chunks(h * w))
            .for_each(|(o, xp)| self.plane(xp, w, o, None));
        Ok(out)
    }

    /// The input's gradient: each output's gradient to the first maximum of its window (max) or
    /// spread evenly over it (average), planes in parallel.
    fn backward<T: WithDType>(
        &self,
        x: &[T],
        g: &[T],
        dims: (usize, usize, usize, usize),
    ) -> Result<Vec<T>> {
        let (n, c, h, w) = dims;
        let (oh, ow) = self.out_hw(h, w)?;
        let mut dx = vec![T::zero(); n * c * h * w];
        dx.par_chunks_mut(h * w)
            .zip(x.par_chunks(h * w))
            .zip(g.par_chunks(oh * ow))
            .for_each_init(
                || self.scratch(h, w),
                |scratch, ((dxp, xp), gp)| self.plane_backward(xp, w, gp, dxp, scratch),
            );
        Ok(dx)
    }

    /// One plane's input gradient into `dxp`, zero on entry, from the plane `xp` (width `w`)
    /// and its outputs' gradient `gp`. Windows that overlap sum their shares in f64 before the
    /// one rounding to `T`; disjoint windows write theirs directly (the same value).
    pub(crate) fn plane_backward<T: WithDType>(
        &self,
        xp: &[T],
        w: usize,
        gp: &[T],
        dxp: &mut [T],
        scratch: &mut PlaneScratch<T>,
    ) {
        let (kh, kw) = self.kernel;
        let (sh, sw) = self.stride;
        let ow = (w - kw) / sw + 1;
        let overlap = self.overlaps();
        let PlaneScratch { acc, out, arg } = scratch;
        // Each input index and the gradient share it receives.
        let mut add = |i: usize, v: f64| {
            if overlap {
                acc[i] += v;
            } else {
                dxp[i] = T::from_f64(v);
            }
        };
        match self.kind {
            Kind::Max => {
                self.plane(xp, w, out, Some(arg));
                for (&a, go) in arg.iter().zip(gp) {
                    add(a, go.to_f64());
                }
            }
            Kind::Avg => {
                let share = 1.0 / (kh * kw) as f64;
                for (o, go) in gp.iter().enumerate() {
                    let (oy, ox) = (o / ow, o % ow);
                    let v = go.to_f64() * share;
                    for dy in 0..kh {
                        for dxx in 0..kw {
                            add((oy * sh + dy) * w + ox * sw + dxx, v);
                        }
                    }
                }
            }
        }
        if overlap {
            for (d, a) in dxp.iter_mut().zip(acc.iter_mut()) {
                *d = T::from_f64(*a);
                *a = 0.0;
            }
        }
    }
}

/// Whether `v`, later in the window, replaces `best`: larger, or the first NaN.
#[inline(always)]
fn beats<T: WithDType>(v: T, best: T) -> bool {
    #[allow(clippy::eq_op)]
    let nan_over_number = (v != v) & (best == best);
    (v > best) | nan_over_number
}

/// Max pooling of any window, a row of outputs at a time: each window cell, in the row-major
/// order a scan of one window takes, is compared with the running maxima of all the row's
/// outputs before the next cell. Each output sees its cells in the scalar scan's order (the same
/// result, ties and NaNs included), while the row's compares are independent of one another, so
/// the core runs them side by side instead of one chain of dependent selects per window (the
/// ResNet stem's batch norm + ReLU + 3x3 stride-2 pool forward: 24-28 -> 13-16 ms,
/// docs/benchmarks.md; the forward's loop stays scalar, its strided read bounds-checked: with
/// its values gathered first it vectorised but was no faster).
/// `arg` (the backward's) keeps each output's cell as its offset `dy * w + dx` in the window
/// until the row ends, as a `u32` (a `usize` would halve the lanes against `f32` maxima), or a
/// `usize` where a window's rows reach past `u32`; each cell's values are gathered into a row
/// first. So the backward's loop vectorises: it ran scalar, a branch per value (the ResNet10
/// stem's batch norm + ReLU + pool backward 140-157 -> 116-134 ms, docs/benchmarks.md).
#[inline(always)]
fn max_rows<T: WithDType>(
    x: &[T],
    w: usize,
    (kh, kw): (usize, usize),
    (sh, sw): (usize, usize),
    out: &mut [T],
    arg: Option<&mut [usize]>,
) {
    match arg {
        None => max_rows_at::<T, u32>(x, w, (kh, kw), (sh, sw), out, None),
        Some(arg) if kh * w <= u32::MAX as usize => {
            max_rows_at::<T, u32>(x, w, (kh, kw), (sh, sw), out, Some(arg))
        }
        Some(arg) => max_rows_at::<T, usize>(x, w, (kh, kw), (sh, sw), out, Some(arg)),
    }
}

/// A window cell's offset, as narrow as the window allows ([`max_rows`]).
trait Cell: Copy + Default {
    fn of(offset: usize) -> Self;
    fn offset(self) -> usize;
}

impl Cell for u32 {
    #[inline(always)]
    fn of(offset: usize) -> Self {
        offset as u32
    }
    #[inline(always)]
    fn offset(self) -> usize {
        self as usize
    }
}

impl Cell for usize {
    #[inline(always)]
    fn of(offset: usize) -> Self {
        offset
    }
    #[inline(always)]
    fn offset(self) -> usize {
        self
    }
}

#[inline(always)]
fn max_rows_at<T: WithDType, C: Cell>(
    x: &[T],
    w: usize,
    (kh, kw): (usize, usize),
    (sh, sw): (usize, usize),
    out: &mut [T],
    mut arg: Option<&mut [usize]>,
) {
    let ow = (w - kw) / sw + 1;
    // The inputs one cell reads across a row: ow of them, sw apart.
    let reach = (ow - 1) * sw + 1;
    // Each output's best cell so far in this row.
    // (The forward, without `arg`, needs neither.)
    let n = if arg.is_some() { ow } else { 0 };
    let (mut cells, mut vals) = (vec![C::default(); n], vec![T::zero(); n]);
    for (oy, row) in out.chunks_mut(ow).enumerate() {
        let top = oy * sh * w;
        gather(row, &x[top..][..reach], sw);
        cells.fill(C::default());
        for dy in 0..kh {
            for dx in 0..kw {
                if dy + dx == 0 {
                    continue;
                }
                let cell = dy * w + dx;
                let src = &x[top + cell..][..reach];
                if arg.is_none() {
                    for (i, y) in row.iter_mut().enumerate() {
                        let v = src[i * sw];
                        *y = if beats(v, *y) { v } else { *y };
                    }
                } else {
                    // The cell's values gathered first: with `src[i * sw]` in it (a bounds
                    // check per value) the loop below stayed scalar, a branch per value.
                    gather(&mut vals, src, sw);
                    let c = C::of(cell);
                    for ((y, a), &v) in row.iter_mut().zip(cells.iter_mut()).zip(&vals) {
                        let take = beats(v, *y);
                        *y = if take { v } else { *y };
                        *a = if take { c } else { *a };
                    }
                }
            }
        }
        if let Some(arg) = arg.as_deref_mut() {
            let at = &mut arg[oy * ow..][..ow];
            for (i, (a, c)) in at.iter_mut().zip(&cells).enumerate() {
                *a = top + i * sw + c.offset();
            }
        }
    }
}

/// Max pooling 2x2 with stride 2 (every CNN backbone's), a row pair at a time without index
/// arithmetic or bounds checks in the loop; the same result as the general loop.
fn max_2x2<T: WithDType>(x: &[T], w: usize, out: &mut [T], arg: Option<&mut [usize]>) {
    let ow = w / 2;
    let rows = out.chunks_mut(ow).enumerate();
    let window = |a: &[T], b: &[T]| {
        let (mut best, mut at) = (a[0], 0);
        for (i, v) in [(1, a[1]), (2, b[0]), (3, b[1])] {
            let take = beats(v, best);
            best = if take { v } else { best };
            at = if take { i } else { at };
        }
        (best, at)
    };
    match arg {
        None => {
            for (oy, row) in rows {
                let (r0, r1) = (&x[2 * oy * w..][..2 * ow], &x[(2 * oy + 1) * w..][..2 * ow]);
                for ((y, a), b) in row
                    .iter_mut()
                    .zip(r0.chunks_exact(2))
                    .zip(r1.chunks_exact(2))
                {
                    *y = window(a, b).0;
                }
            }
        }
        Some(arg) => {
            for ((oy, row), arg) in rows.zip(arg.chunks_mut(ow)) {
                let (r0, r1) = (&x[2 * oy * w..][..2 * ow], &x[(2 * oy + 1) * w..][..2 * ow]);
                let cells = row
                    .iter_mut()
                    .zip(arg)
                    .zip(r0.chunks_exact(2))
                    .zip(r1.chunks_exact(2));
                for (ox, (((y, g), a), b)) in cells.enumerate() {
                    let (best, at) = window(a, b);
                    *y = best;
                    // Window cell `at` (row-major in the 2x2) as a plane index.
                    *g = (2 * oy + at / 2) * w + 2 * ox + at % 2;
                }
            }
        }
    }
}

/// Dimensions of an [N, C, H, W] layout.
fn dims4(l: &Layout) -> Result<(usize, usize, usize, usize)> {
    match l.dims() {
        [n, c, h, w] => Ok((*n, *c, *h, *w)),
        d => candle_core::bail!("pool expects [N, C, H, W], got {d:?}"),
    }
}

impl CustomOp1 for Pool {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Max => "ft-max-pool2d",
            Kind::Avg => "ft-avg-pool2d",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = dims4(l)?;
        let (oh, ow) = self.out_hw(dims.2, dims.3)?;
        let out = match s {
            CpuStorage::F32(d) => CpuStorage::F32(self.forward(cpu::slice(d, l)?, dims)?),
            CpuStorage::F64(d) => CpuStorage::F64(self.forward(cpu::slice(d, l)?, dims)?),
            CpuStorage::F16(d) => CpuStorage::F16(self.forward(cpu::slice(d, l)?, dims)?),
            CpuStorage::BF16(d) => CpuStorage::BF16(self.forward(cpu::slice(d, l)?, dims)?),
            _ => candle_core::bail!("pool: unsupported dtype"),
        };
        Ok((out, Shape::from((dims.0, dims.1, oh, ow))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, c, h, w) = match l.dims() {
            [n, c, h, w] => (*n, *c, *h, *w),
            d => candle_core::bail!("pool expects [N, C, H, W], got {d:?}"),
        };
        let (oh, ow) = self.out_hw(h, w)?;
        let out = crate::cuda::pool_forward(s, l, self.spec(), (oh, ow))?;
        Ok((out, Shape::from((n, c, oh, ow))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if arg.device().is_cuda() {
            return Ok(Some(crate::cuda::pool_backward(arg, g, self.spec())?));
        }
        Ok(Some(
            arg.contiguous()?
                .apply_op2_no_bwd(&g.contiguous()?, &Backward(*self))?,
        ))
    }
}

/// The CPU backward as an op on (input, output gradient), so it reads both in their dtype
/// without copies.
struct Backward(Pool);

impl CustomOp2 for Backward {
    fn name(&self) -> &'static str {
        "ft-pool2d-backward"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = dims4(xl)?;
        let (oh, ow) = self.0.out_hw(dims.2, dims.3)?;
        if gl.dims() != [dims.0, dims.1, oh, ow] {
            candle_core::bail!(
                "pool backward: gradient {:?} for output {:?}",
                gl.dims(),
                (dims.0, dims.1, oh, ow)
            );
        }
        let p = &self.0;
        let out = match (xs, gs) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => {
                CpuStorage::F32(p.backward(cpu::slice(x, xl)?, cpu::slice(g, gl)?, dims)?)
            }
            (CpuStorage::F64(x), CpuStorage::F64(g)) => {
                CpuStorage::F64(p.backward(cpu::slice(x, xl)?, cpu::slice(g, gl)?, dims)?)
            }
            (CpuStorage::F16(x), CpuStorage::F16(g)) => {
                CpuStorage::F16(p.backward(cpu::slice(x, xl)?, cpu::slice(g, gl)?, dims)?)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(g)) => {
                CpuStorage::BF16(p.backward(cpu::slice(x, xl)?, cpu::slice(g, gl)?, dims)?)
            }
            _ => candle_core::bail!("pool backward: input and gradient differ in dtype"),
        };
        Ok((out, xl.shape().clone()))
    }
}

fn pool(x: &Tensor, kind: Kind, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor> {
    if !crate::has_kernel(x) {
        candle_core::bail!(
            "pooling runs on the CPU or CUDA (f32, bf16, f16); got {:?} on {:?}",
            x.dtype(),
            x.device()
        );
    }
    x.contiguous()?.apply_op1(Pool {
        kind,
        kernel,
        stride,
    })
}

/// Max pooling; the gradient goes to the first maximum of each window.
pub fn max_pool2d(x: &Tensor, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor> {
    pool(x, Kind::Max, kernel, stride)
}

/// Average pooling (no padding, so every window has k*k elements).
pub fn avg_pool2d(x: &Tensor, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor> {
    pool(x, Kind::Avg, kernel, stride)
}

/// Global average pooling [N, C, H, W] -> [N, C] (a mean, whose backward candle gets right).
pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
    x.flatten_from(2)?.mean(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both cell widths (`usize` is for windows whose rows reach past `u32`, too large to build
    /// here) give the maxima and positions of a plain scan of each window in row-major order,
    /// the first of equal maxima and the first NaN winning, at every stride.
    #[test]
    fn both_cell_widths_find_the_scans_cells() {
        let (h, w) = (9, 11);
        // Ties (values repeat every 7) and two NaNs.
        let mut x: Vec<f32> = (0..h * w).map(|i| ((i * 5) % 7) as f32).collect();
        x[13] = f32::NAN;
        x[40] = f32::NAN;
        for (k, s) in [(2, 1), (3, 2), (3, 3), (2, 2)] {
            let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
            let mut want = vec![];
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut best = (oy * s) * w + ox * s;
                    for dy in 0..k {
                        for dx in 0..k {
                            let at = (oy * s + dy) * w + ox * s + dx;
                            let better = x[at] > x[best] || (x[at].is_nan() && !x[best].is_nan());
                            if better {
                                best = at;
                            }
                        }
                    }
                    want.push((x[best].to_bits(), best));
                }
            }
            for wide in [false, true] {
                let (mut out, mut arg) = (vec![0f32; oh * ow], vec![0usize; oh * ow]);
                let x = &x[..((oh - 1) * s + k) * w];
                if wide {
                    max_rows_at::<f32, usize>(x, w, (k, k), (s, s), &mut out, Some(&mut arg));
                } else {
                    max_rows_at::<f32, u32>(x, w, (k, k), (s, s), &mut out, Some(&mut arg));
                }
                let got: Vec<_> = out.iter().map(|v| v.to_bits()).zip(arg).collect();
                assert_eq!(got, want, "{k}x{k} stride {s}, usize cells: {wide}");
            }
        }
    }
}
