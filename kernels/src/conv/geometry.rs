//! The geometry of one convolution and the moves between an image and its columns: unfolding
//! (one image, or all of them for the low-precision path), folding back (the adjoint) and the
//! rule for when images go on rayon's threads.

use candle_core::{Result, WithDType};

use crate::cpu::gather;

/// Geometry of one convolution: square kernel, equal stride and padding on both axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    pub(super) b: usize,
    pub(super) c: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) k: usize,
    pub(super) stride: usize,
    pub(super) pad: usize,
}

impl Geometry {
    pub(super) fn new(dims: &[usize], k: usize, stride: usize, pad: usize) -> Result<Self> {
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

    pub(super) fn out_hw(&self) -> (usize, usize) {
        (
            (self.h + 2 * self.pad - self.k) / self.stride + 1,
            (self.w + 2 * self.pad - self.k) / self.stride + 1,
        )
    }

    /// Columns per image (output positions) and column length (C k k).
    pub(super) fn cols(&self) -> (usize, usize) {
        let (oh, ow) = self.out_hw();
        (oh * ow, self.c * self.k * self.k)
    }

    /// Whether the groups of images ([`Self::group`]) go on rayon's threads, one each (each with
    /// its own column buffer and product on one thread): when there are groups and threads to
    /// share and either an image's columns are too few for its unfolding and folding to be worth
    /// splitting ([`PAR_ELEMS`]) or a group's product is small enough ([`TASK_MACS`]) that
    /// gemm's own threads would slow it down. Each group's values are computed as on one
    /// thread, so the result does not change.
    /// The column buffers, one a thread, stay under [`TASK_COLS`] values in all (a UNet's
    /// `conv_out` at 64 x 64 latents has a small product but 11.8 million column values an
    /// image).
    pub(super) fn images_in_parallel(&self, o: usize) -> bool {
        let (l, ck) = self.cols();
        let threads = rayon::current_num_threads();
        let small = ck * l < PAR_ELEMS
            || (o * ck * self.group() * l < TASK_MACS
                && ck * self.group() * l * threads <= TASK_COLS);
        small && self.groups() > 1 && threads > 1
    }

    /// Rows of the columns (channel and kernel tap pairs) in one part of the weight gradient:
    /// at most [`PARTS`] parts of a multiple of 16 rows, at least 32 (the last may be shorter;
    /// 27 rows, Conv4's first layer, make one part). From the shape alone, so the sums do not
    /// depend on the threads.
    pub(super) fn part_rows(&self) -> usize {
        let ck = self.cols().1.max(1);
        ck.div_ceil(PARTS).next_multiple_of(16).max(32)
    }

    /// Images multiplied together: enough that a product has [`GROUP_COLS`] columns. A deep
    /// layer's image has few output positions (ResNet's last stage at 84 px: 9), and a product
    /// per image that narrow (or, for the weight gradient, that short) spends its time packing
    /// operands, not multiplying. From a shape alone, so the sums do not depend on the threads.
    pub(super) fn group(&self) -> usize {
        let l = self.cols().0.max(1);
        GROUP_COLS.div_ceil(l).clamp(1, self.b.max(1))
    }

    /// How many groups of [`Self::group`] images the batch makes.
    pub(super) fn groups(&self) -> usize {
        self.b.div_ceil(self.group())
    }

    /// Calls `f(column index within the image, offset in the column, input offset)` for every
    /// in-bounds (output position, kernel tap) pair of image `bi`.
    pub(super) fn for_each_tap(&self, bi: usize, mut f: impl FnMut(usize, usize, usize)) {
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
    pub(super) fn im2col<T: WithDType>(&self, x: &[T]) -> Vec<T> {
        let (l, ck) = self.cols();
        let mut out = vec![T::zero(); self.b * l * ck];
        for bi in 0..self.b {
            let o = &mut out[bi * l * ck..(bi + 1) * l * ck];
            self.for_each_tap(bi, |col, j, src| o[col * ck + j] = x[src]);
        }
        out
    }

    /// Rows `rows` of image `bi` of `x` (contiguous [B, C, H, W]) as columns (of all rows:
    /// [C*k*k, Ho*Wo]) in `cols`, zeros where the kernel hangs over the edge: each row (a channel
    /// and kernel tap) on its own, on rayon's threads when the rows are many and `at.threads`.
    /// Row `rows.start + i` starts at `i * at.stride + at.offset`: a group of images side by side
    /// has `stride` = the group's columns and `offset` = this image's first.
    pub(super) fn image_columns<T: WithDType>(
        &self,
        x: &[T],
        bi: usize,
        rows: std::ops::Range<usize>,
        cols: &mut [T],
        at: ColsAt,
    ) {
        let (oh, ow) = self.out_hw();
        let l = oh * ow;
        let (k, s, p) = (self.k, self.stride, self.pad as isize);
        // Stride 1 with the output the input's size (3x3 padded by 1, 1x1 by 0, 5x5 by 2): each
        // row is the plane shifted, one copy (`shifted_plane`).
        let same = s == 1 && (oh, ow) == (self.h, self.w);
        let fill = |j: usize, row: &mut [T]| {
            let (ci, tap) = (j / (k * k), j % (k * k));
            let (ky, kx) = (tap / k, tap % k);
            let plane = &x[(bi * self.c + ci) * self.h * self.w..][..self.h * self.w];
            if same {
                let shift = (ky as isize - p, kx as isize - p);
                return shifted_plane(plane, (self.h, self.w), shift, row);
            }
            let (lo, hi, base) = self.inside(kx);
            for oy in 0..oh {
                let out = &mut row[oy * ow..(oy + 1) * ow];
                let y = (oy * s) as isize + ky as isize - p;
                if y < 0 || y >= self.h as isize {
                    out.fill(T::zero());
                    continue;
                }
                let src = &plane[y as usize * self.w..][..self.w];
                out[..lo].fill(T::zero());
                out[hi..].fill(T::zero());
                gather(&mut out[lo..hi], &src[base..], s);
            }
        };
        let (stride, offset) = (at.stride.max(1), at.offset);
        let first = rows.start;
        let out = &mut cols[..rows.len() * stride];
        let fill = |i: usize, row: &mut [T]| fill(first + i, &mut row[offset..][..l]);
        if at.threads && rows.len() * l >= PAR_ELEMS {
            use rayon::prelude::*;
            out.par_chunks_mut(stride)
                .enumerate()
                .for_each(|(i, row)| fill(i, row));
        } else {
            out.chunks_mut(stride)
                .enumerate()
                .for_each(|(i, row)| fill(i, row));
        }
    }

    /// For kernel column `kx`: the output columns `lo..hi` whose input column
    /// (`ox * stride + kx - pad`) lies inside the image (the others read the zero padding), and
    /// `base`, the input column of `lo` (column `lo + i` reads `base + i * stride`). So the
    /// unfolding and the fold loop over the inside without a test per value.
    fn inside(&self, kx: usize) -> (usize, usize, usize) {
        let (ow, s) = (self.out_hw().1, self.stride.max(1));
        let (w, p) = (self.w, self.pad);
        // The first ox with ox * s + kx >= p, and one past the last with ox * s + kx < p + w.
        let lo = p.saturating_sub(kx).div_ceil(s).min(ow);
        let hi = if p + w > kx {
            (p + w - kx).div_ceil(s).min(ow)
        } else {
            0
        }
        .max(lo);
        // An empty range reads nothing: its base is 0, inside any row.
        let base = if hi > lo {
            (lo * s + kx).saturating_sub(p)
        } else {
            0
        };
        (lo, hi, base)
    }

    /// The adjoint of [`Self::image_columns`]: the column gradient `dcols` [C*k*k, Ho*Wo] of image
    /// `bi` summed back onto its input positions in `dx` ([C, H, W] of that image), in f64, each
    /// channel on its own (on rayon's threads when the image is large and `at.threads`), the
    /// taps in order. Rows are laid out as [`Self::image_columns`] writes all of them (`at`).
    /// `dcols` is scratch: the values that fall on the padding may be zeroed (stride 1 with the
    /// output the input's size adds each row as one run, [`add_shifted_plane`]). The loops run
    /// on the widest vector unit ([`crate::wide::run`]).
    pub(super) fn fold_image<T: WithDType>(&self, dcols: &mut [T], dx: &mut [T], at: ColsAt) {
        let (stride, offset) = (at.stride, at.offset);
        let (oh, ow) = self.out_hw();
        let l = oh * ow;
        let (k, s, p) = (self.k, self.stride, self.pad as isize);
        let hw = self.h * self.w;
        let same = s == 1 && (oh, ow) == (self.h, self.w);
        // `acc`: a channel's sums, one buffer a rayon job (`for_each_init`; a fresh one a
        // channel was a sixth of the fold's samples in ResNet10's episode: the allocator and
        // the zeroing).
        let fold = |acc: &mut Vec<f64>, rows: &mut [T], out: &mut [T]| {
            crate::wide::run(
                #[inline(always)]
                || {
                    acc.clear();
                    acc.resize(hw, 0.0);
                    let acc = &mut acc[..];
                    for tap in 0..k * k {
                        let (ky, kx) = (tap / k, tap % k);
                        let row = &mut rows[tap * stride + offset..][..l];
                        if same {
                            let shift = (ky as isize - p, kx as isize - p);
                            add_shifted_plane(row, (self.h, self.w), shift, acc);
                            continue;
                        }
                        let (lo, hi, base) = self.inside(kx);
                        for oy in 0..oh {
                            let y = (oy * s) as isize + ky as isize - p;
                            if y < 0 || y >= self.h as isize {
                                continue;
                            }
                            let dst = &mut acc[y as usize * self.w..][..self.w];
                            let g = &row[oy * ow..(oy + 1) * ow][lo..hi];
                            if s == 1 {
                                for (d, g) in dst[base..][..hi - lo].iter_mut().zip(g) {
                                    *d += g.to_f64();
                                }
                            } else {
                                for (i, g) in g.iter().enumerate() {
                                    dst[base + i * s] += g.to_f64();
                                }
                            }
                        }
                    }
                    for (o, a) in out.iter_mut().zip(acc.iter()) {
                        *o = T::from_f64(*a);
                    }
                },
            )
        };
        // Channel `ci`'s rows: `(ci * k * k + tap) * stride + offset`.
        let rows_a_channel = (k * k * stride).max(1);
        if at.threads && self.c * k * k * l >= PAR_ELEMS {
            use rayon::prelude::*;
            dx.par_chunks_mut(hw.max(1))
                .zip(dcols.par_chunks_mut(rows_a_channel))
                .for_each_init(Vec::new, |acc, (out, rows)| fold(acc, rows, out));
        } else {
            let mut acc = Vec::new();
            dx.chunks_mut(hw.max(1))
                .zip(dcols.chunks_mut(rows_a_channel))
                .for_each(|(out, rows)| fold(&mut acc, rows, out));
        }
    }

    /// The adjoint of `im2col`: sums every column entry back into the input position it came from.
    pub(super) fn col2im(&self, cols: &[f64]) -> Vec<f64> {
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
pub(super) const PAR_ELEMS: usize = 1 << 16;

/// Multiply-adds of a group's product under which its images go on rayon's threads a group
/// each, each product on one thread ([`Geometry::images_in_parallel`]). On two cores
/// (`examples/time_gemm_shapes`) gemm's own threads ran ResNet10's first-stage product
/// (64 x 441 x 576) at 82 GFLOP/s against 148 on one thread, and a UNet layer's (320 x 256 x
/// 2880, 236 million) at 294 against 176 each for two side by side; from 512 x 512 x 2048
/// (2^29) on, gemm's threads (322) are about as fast as two products at once, and keep one
/// column buffer. (Such a product now runs in `crate::gemm_blocks`' blocks, one a thread,
/// rather than on gemm's threads.)
pub(super) const TASK_MACS: usize = 1 << 29;

/// Column values that the groups' buffers on rayon's threads may hold together (64 MiB in f32).
pub(super) const TASK_COLS: usize = 1 << 24;

/// Parts at most that the weight gradient's columns are split into ([`Geometry::part_rows`]),
/// each unfolded and multiplied on its own, on rayon's threads.
pub(super) const PARTS: usize = 8;

/// Where an unfolding writes its rows (and a folding reads them): row `i` at
/// `i * stride + offset`, and whether it may split its work over rayon's threads (not when it
/// already runs on one of them, a group or a part each).
#[derive(Debug, Clone, Copy)]
pub(super) struct ColsAt {
    pub(super) stride: usize,
    pub(super) offset: usize,
    pub(super) threads: bool,
}

/// Columns a product should have at least before images are grouped into it ([`Geometry::group`]):
/// images of this many output positions or more go one by one, as before groups.
pub(super) const GROUP_COLS: usize = 256;

/// `out` ([h, w], flat) = `plane` ([h, w]) read `(dy, dx)` away: `out[y][x] = plane[y + dy][x +
/// dx]`, zero where that falls outside the plane. Row by row that is a run of at most `w`
/// values (21 in ResNet10's first stage) and a copy call each; flat it is one run, offset by
/// `dy w + dx`, over the rows that read inside the plane, after which the `|dx|` values at each
/// of those rows' edge, which read the neighbouring row, are set to zero (ResNet10's episode:
/// the unfolding 10.3% -> 6.4% of the samples, docs/benchmarks.md).
fn shifted_plane<T: WithDType>(
    plane: &[T],
    (h, w): (usize, usize),
    shift: (isize, isize),
    out: &mut [T],
) {
    debug_assert!(plane.len() == h * w && out.len() == h * w);
    let sh = Shift::of((h, w), shift);
    out[..sh.rows.start * w].fill(T::zero());
    out[sh.rows.end * w..].fill(T::zero());
    if sh.rows.is_empty() {
        return;
    }
    if !sh.run.is_empty() {
        let src = sh.run.start.wrapping_add_signed(sh.off);
        out[sh.run.clone()].copy_from_slice(&plane[src..src + sh.run.len()]);
    }
    out[sh.rows.start * w..sh.run.start].fill(T::zero());
    out[sh.run.end..sh.rows.end * w].fill(T::zero());
    sh.zero_edges(&mut out[sh.rows.start * w..sh.rows.end * w], w);
}

/// Where a plane read `(dy, dx)` away lies in it, for [`shifted_plane`] and
/// [`add_shifted_plane`]: the rows whose source (target) row is inside, the run of flat
/// positions whose source (target), `i + off`, is inside, and the edge columns of each of those
/// rows that reach past the plane's width (flat, into the neighbouring row).
struct Shift {
    rows: std::ops::Range<usize>,
    run: std::ops::Range<usize>,
    off: isize,
    edge: std::ops::Range<usize>,
}

impl Shift {
    fn of((h, w): (usize, usize), (dy, dx): (isize, isize)) -> Self {
        let (hi, wi) = (h as isize, w as isize);
        let y0 = (-dy).clamp(0, hi) as usize;
        let y1 = (hi - dy).clamp(y0 as isize, hi) as usize;
        // Only the run's first or last |dx| values can fall outside: edge values.
        let off = dy * wi + dx;
        let (start, end) = ((y0 * w) as isize, (y1 * w) as isize);
        let lo = start.max(-off).min(end);
        let hi_run = end.min(hi * wi - off).max(lo);
        let edge = if dx < 0 {
            0..(-dx).min(wi) as usize
        } else {
            (wi - dx).max(0) as usize..w
        };
        Shift {
            rows: y0..y1,
            run: lo as usize..hi_run as usize,
            off,
            edge,
        }
    }

    /// Zeroes the edge columns of `rows` (whole rows of `w`).
    fn zero_edges<T: WithDType>(&self, rows: &mut [T], w: usize) {
        if !self.edge.is_empty() {
            for row in rows.chunks_mut(w) {
                row[self.edge.clone()].fill(T::zero());
            }
        }
    }
}

/// The adjoint of [`shifted_plane`]: `acc[y + dy][x + dx] += g[y][x]` (in f64) wherever that is
/// inside the plane. As one run, offset by `dy w + dx`, over the rows whose target row is
/// inside, after the `|dx|` values at each of those rows' edge, whose targets are on the
/// padding (flat, the neighbouring row's edge), are set to zero in `g`: adding zero leaves a
/// sum that started at +0.0 as it was (round to nearest never makes it -0.0), so each target
/// gets the same additions as row by row, where a row of ResNet10's first stage was 20
/// values, most of them in the vector loop's scalar remainder.
#[inline(always)]
fn add_shifted_plane<T: WithDType>(
    g: &mut [T],
    (h, w): (usize, usize),
    shift: (isize, isize),
    acc: &mut [f64],
) {
    debug_assert!(g.len() == h * w && acc.len() == h * w);
    let sh = Shift::of((h, w), shift);
    if sh.rows.is_empty() {
        return;
    }
    sh.zero_edges(&mut g[sh.rows.start * w..sh.rows.end * w], w);
    if !sh.run.is_empty() {
        let dst = sh.run.start.wrapping_add_signed(sh.off);
        let targets = &mut acc[dst..dst + sh.run.len()];
        for (a, v) in targets.iter_mut().zip(&g[sh.run.clone()]) {
            *a += v.to_f64();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every small geometry of 2 images of 3 channels: kernels wider than the image, padding
    /// past the kernel's reach, images one value wide or tall (over 100 of them).
    fn small_geometries() -> Vec<Geometry> {
        let mut all = Vec::new();
        for (h, w) in [(1, 1), (1, 4), (4, 1), (2, 3), (5, 4), (6, 6)] {
            for k in 1..=5 {
                for pad in 0..=2 {
                    for stride in 1..=3 {
                        all.extend(Geometry::new(&[2, 3, h, w], k, stride, pad).ok());
                    }
                }
            }
        }
        assert!(all.len() > 100, "{} geometries", all.len());
        all
    }

    /// The unfolding by rows (with its one-copy path for stride 1 at the input's size) against
    /// the reference [`Geometry::im2col`], tap by tap, over [`small_geometries`].
    #[test]
    fn image_columns_are_im2col_transposed() {
        for g in small_geometries() {
            let x: Vec<f32> = (0..g.b * g.c * g.h * g.w).map(|i| i as f32 + 1.0).collect();
            let (l, ck) = g.cols();
            let want = g.im2col(&x);
            for bi in 0..g.b {
                // Garbage first, so that a value left unwritten shows.
                let mut cols = vec![f32::NAN; ck * l];
                let at = ColsAt {
                    stride: l,
                    offset: 0,
                    threads: false,
                };
                g.image_columns(&x, bi, 0..ck, &mut cols, at);
                for j in 0..ck {
                    for col in 0..l {
                        let (got, want) = (cols[j * l + col], want[(bi * l + col) * ck + j]);
                        assert!(
                            got.to_bits() == want.to_bits(),
                            "{g:?} image {bi} row {j} column {col}: {got} != {want}"
                        );
                    }
                }
            }
        }
    }

    /// The fold (one run a tap at stride 1 and the input's size, rows elsewhere; images side by
    /// side) against the reference [`Geometry::col2im`], bit for bit after rounding to f32,
    /// over [`small_geometries`].
    #[test]
    fn fold_image_is_col2im() {
        for g in small_geometries() {
            let (b, chw) = (g.b, g.c * g.h * g.w);
            let (l, ck) = g.cols();
            // Values whose sums round: a fold summing in another order shows.
            let val = |i: usize| ((i * 7919 % 1009) as f32 - 504.5) * 1.37e-3;
            let cols: Vec<f64> = (0..b * l * ck).map(|i| f64::from(val(i))).collect();
            let want = g.col2im(&cols);
            // [CK, B L]: both images side by side, as a group's product writes them.
            let mut dcols = vec![0f32; ck * b * l];
            for bi in 0..b {
                for col in 0..l {
                    for j in 0..ck {
                        dcols[j * b * l + bi * l + col] = cols[(bi * l + col) * ck + j] as f32;
                    }
                }
            }
            let mut got = vec![f32::NAN; b * chw];
            for (bi, dxb) in got.chunks_mut(chw).enumerate() {
                let at = ColsAt {
                    stride: b * l,
                    offset: bi * l,
                    threads: false,
                };
                g.fold_image(&mut dcols, dxb, at);
            }
            for (i, (got, want)) in got.iter().zip(&want).enumerate() {
                let want = *want as f32;
                assert!(
                    got.to_bits() == want.to_bits(),
                    "{g:?} value {i}: {got} != {want}"
                );
            }
        }
    }
}
