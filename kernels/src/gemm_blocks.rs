//! Matrix products on the CPU (f32, f64) split into blocks of the output, one block a rayon
//! task with its product on one thread.
//!
//! gemm's own threads split a product over both output axes with a plan that changes from call
//! to call; at the shapes a UNet's and a transformer's layers run (one axis short: 64 to 256
//! channels against 1,024 positions or tokens) they reach 120-230 GFLOP/s on this VM's two
//! cores where the same product in two blocks of its long axis, each on one thread, reaches
//! 200-310 (`cargo run --release -p ft-kernels --example time_gemm_shapes`). Here the long
//! output axis is cut into one block a thread ([`blocks`]), each block's product runs on one
//! thread, and the blocks go on rayon's threads. gemm sums the inner axis in an order
//! fixed by its length (its `kc` depends on `k` only, on the path every block is kept on:
//! [`blocks`]) and never splits it, so every value is the same however the output is cut and
//! whatever the thread count.

use candle_core::{Result, WithDType};

/// A float gemm multiplies here: f32 and f64.
pub trait GemmFloat: WithDType + Send + Sync {}
impl GemmFloat for f32 {}
impl GemmFloat for f64 {}

/// A row-major matrix operand: its values, whether they hold it transposed (the row-major
/// storage of its transpose), and how many values apart the stored rows start (0: one stored
/// row's length, rows packed).
#[derive(Clone, Copy)]
pub struct Mat<'a, T> {
    pub data: &'a [T],
    pub transposed: bool,
    pub ld: usize,
}

impl<'a, T> Mat<'a, T> {
    /// Rows packed.
    pub fn new(data: &'a [T], transposed: bool) -> Self {
        Mat {
            data,
            transposed,
            ld: 0,
        }
    }

    /// Stored rows `ld` values apart (at least a stored row's length): see [`spread_rows`].
    pub fn rows_apart(data: &'a [T], transposed: bool, ld: usize) -> Self {
        Mat {
            data,
            transposed,
            ld,
        }
    }

    /// (stored rows, stored row length, values between stored rows) of this `rows x cols`
    /// operand.
    fn stored(&self, rows: usize, cols: usize) -> (usize, usize, usize) {
        let (sr, sc) = if self.transposed {
            (cols, rows)
        } else {
            (rows, cols)
        };
        (sr, sc, if self.ld == 0 { sc } else { self.ld })
    }

    /// (row stride, column stride) of this `rows x cols` operand.
    fn strides(&self, rows: usize, cols: usize) -> (usize, usize) {
        let (_, _, ld) = self.stored(rows, cols);
        if self.transposed {
            (1, ld)
        } else {
            (ld, 1)
        }
    }

    /// Whether the values hold this `rows x cols` operand, its stored rows not overlapping
    /// (false where the lengths overflow).
    fn fits(&self, rows: usize, cols: usize) -> bool {
        let (sr, sc, ld) = self.stored(rows, cols);
        if sr == 0 || sc == 0 {
            return true;
        }
        ld >= sc
            && (sr - 1)
                .checked_mul(ld)
                .and_then(|v| v.checked_add(sc))
                .is_some_and(|need| self.data.len() >= need)
    }
}

/// A row length of at least `len` values of `T` for a buffer whose rows gemm reads across
/// (an operand it packs with rows strided: a convolution's columns in its weight gradient,
/// where gemm turns the product around for a row-major output and gathers 64 of those rows a
/// step): whole 64-byte cache lines, an odd number of them. Rows a power of two of lines apart
/// (1024 f32, a 32x32 plane) all fall in one set of the L1 cache, which holds 8 of them, and
/// the gather then missed on nearly every value.
pub fn spread_rows<T>(len: usize) -> usize {
    let line = (64 / std::mem::size_of::<T>().max(1)).max(1);
    let lines = len.div_ceil(line);
    (lines + (1 - lines % 2)) * line
}

/// Multiply-adds a block has at least: below 2^21 (64 x 64 x 441, a ResNet weight gradient's
/// part) a product cut in two ran slower than on one thread.
const BLOCK_MACS: usize = 1 << 21;

/// Shortest block along the cut axis: gemm takes another path (and another inner block size,
/// `kc = min(k, 512)`) for a product whose output sides are both 64 or less, so a block that
/// short could round differently from the whole product.
const MIN_BLOCK: usize = 65;

/// How a `m x n` output (inner length `k`) is cut for `threads` threads: along rows (`true`) or
/// columns, whichever is longer, into at most one block a thread of at least [`BLOCK_MACS`],
/// and the block length along that axis, a multiple of 16 (the last block may be shorter, but
/// no block is under [`MIN_BLOCK`]); the whole length where it is not cut. More blocks than
/// threads ran slower (eight blocks on two threads: 180-220 GFLOP/s against two blocks'
/// 175-260).
///
/// A cut must keep every block on the path gemm takes for the whole product (gemm-common
/// 0.19's `gemm_basic_generic`), whose inner blocks then depend on `k` alone: not both output
/// sides 64 or less (`kc = min(k, 512)` instead), not 256 outputs or fewer (a path with
/// `kc = 1024`), not one row or column (gemv), not `k <= 2`. So a product whose short side is
/// under 4 or whose `k` is 2 or less is never cut, and neither is one whose blocks would be
/// under [`MIN_BLOCK`] long (a short side of 4 or more then makes over 256 outputs a block).
fn blocks(m: usize, n: usize, k: usize, threads: usize) -> (bool, usize) {
    let rows = m >= n;
    let (long, short) = if rows { (m, n) } else { (n, m) };
    let mut count = (m * n * k / BLOCK_MACS).clamp(1, threads.max(1));
    if short < 4 || k <= 2 {
        count = 1;
    }
    while count > 1 {
        let len = long.div_ceil(count).next_multiple_of(16);
        let last = long - (long.div_ceil(len) - 1) * len;
        if len >= MIN_BLOCK && last >= MIN_BLOCK {
            return (rows, len);
        }
        count -= 1;
    }
    (rows, long.max(1))
}

/// A pointer shared by the blocks of one product, each of which writes its own part of it.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: the blocks of `product` write disjoint parts of the output and only read the
// operands, and `column_blocks` hands each task columns no other task writes; the pointer
// outlives the scope they run in.
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// The pointer (a method, so that a closure captures the `Send` wrapper, not its field).
    fn at(self, offset: usize) -> *mut T {
        self.0.wrapping_add(offset)
    }
}

/// `dst` (m x n, row-major) = `lhs` (m x k) x `rhs` (k x n), or `dst +=` it with `accumulate`.
/// On rayon's threads, a block each, when `threads` allows it (not when the caller already runs
/// on rayon's threads, one product each) and the product is large enough to cut; the values do
/// not depend on either. Lengths are checked before gemm reads them.
#[allow(clippy::too_many_arguments)]
pub fn product<T: GemmFloat>(
    dst: &mut [T],
    lhs: Mat<T>,
    rhs: Mat<T>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    threads: bool,
) -> Result<()> {
    scaled_product(dst, lhs, rhs, m, n, k, T::one(), accumulate, threads)
}

/// [`product`] of `scale` times the operands' product: gemm's own factor on each sum, one
/// rounding (the same bits as multiplying the finished product, for `k` within gemm's one
/// inner block of at least 512).
#[allow(clippy::too_many_arguments)]
pub fn scaled_product<T: GemmFloat>(
    dst: &mut [T],
    lhs: Mat<T>,
    rhs: Mat<T>,
    m: usize,
    n: usize,
    k: usize,
    scale: T,
    accumulate: bool,
    threads: bool,
) -> Result<()> {
    if !holds(dst.len(), m, n) || !lhs.fits(m, k) || !rhs.fits(k, n) {
        candle_core::bail!(
            "matrix product: a {m}x{k} by {k}x{n} product with {}, {} and {} values",
            lhs.data.len(),
            rhs.data.len(),
            dst.len()
        );
    }
    // SAFETY: `dst` holds the m x n values (checked), rows of n, and is borrowed mutably.
    unsafe {
        product_raw(
            Shared(dst.as_mut_ptr()),
            n,
            lhs,
            rhs,
            (m, n, k),
            scale,
            accumulate,
            threads,
        )
    }
}

/// Whether `len` values hold a `rows x cols` matrix (false where the product overflows: in a
/// release build an unchecked product could wrap to a small number and pass).
fn holds(len: usize, rows: usize, cols: usize) -> bool {
    rows.checked_mul(cols).is_some_and(|need| len >= need)
}

/// [`scaled_product`] into `m` rows of `n` values `ldd` apart from `dst` on.
///
/// # Safety
/// `n <= ldd` (else the rows overlap), `dst` must be valid for reads and writes of those
/// values, which nothing else may access meanwhile, and `lhs` and `rhs` must hold their
/// `m x k` and `k x n` operands ([`Mat::fits`]).
#[allow(clippy::too_many_arguments)]
unsafe fn product_raw<T: GemmFloat>(
    dst: Shared<T>,
    ldd: usize,
    lhs: Mat<T>,
    rhs: Mat<T>,
    (m, n, k): (usize, usize, usize),
    scale: T,
    accumulate: bool,
    threads: bool,
) -> Result<()> {
    debug_assert!(n <= ldd, "rows of {n} values {ldd} apart");
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                // SAFETY: row `i`'s n values are `dst`'s to write (the caller's contract).
                unsafe { std::slice::from_raw_parts_mut(dst.at(i * ldd), n) }.fill(T::zero());
            }
        }
        return Ok(());
    }
    let (lrs, lcs) = lhs.strides(m, k);
    let (rrs, rcs) = rhs.strides(k, n);
    let (by_rows, len) = blocks(m, n, k, rayon::current_num_threads());
    let (out, a, b) = (
        dst,
        Shared(lhs.data.as_ptr() as *mut T),
        Shared(rhs.data.as_ptr() as *mut T),
    );
    // Rows (or columns) `start..start + len` of the output.
    let block = |start: usize, len: usize| {
        let (bm, bn, dst_at, lhs_at, rhs_at) = if by_rows {
            let rows = len.min(m - start);
            (rows, n, start * ldd, start * lrs, 0)
        } else {
            let cols = len.min(n - start);
            (m, cols, start, 0, start * rcs)
        };
        // SAFETY: the caller vouches for the m rows of n values `ldd` apart at `dst` and the
        // operands' lengths, which these strides address; a block covers rows (columns)
        // `start..start + len` of the output and reads only `lhs` and `rhs`, which the output
        // does not alias, so no two blocks write the same value.
        unsafe {
            gemm::gemm(
                bm,
                bn,
                k,
                out.at(dst_at),
                1,
                ldd as isize,
                accumulate,
                a.at(lhs_at) as *const T,
                lcs as isize,
                lrs as isize,
                b.at(rhs_at) as *const T,
                rcs as isize,
                rrs as isize,
                T::one(),
                scale,
                false,
                false,
                false,
                gemm::Parallelism::None,
            )
        }
    };
    let long = if by_rows { m } else { n };
    let count = long.div_ceil(len);
    if threads && count > 1 {
        use rayon::prelude::*;
        (0..count).into_par_iter().for_each(|i| block(i * len, len));
    } else {
        // One block: the same values (the cut changes no sum), without the blocks' packing.
        block(0, long);
    }
    Ok(())
}

/// Columns `start..start + n` of a row-major matrix of `m` rows `ldd` values long, which one
/// task writes while others write the other columns ([`column_blocks`]).
pub struct ColumnBlock<'a, T> {
    dst: Shared<T>,
    ldd: usize,
    m: usize,
    n: usize,
    _dst: std::marker::PhantomData<&'a mut [T]>,
}

impl<T: GemmFloat> ColumnBlock<'_, T> {
    /// Its width.
    pub fn width(&self) -> usize {
        self.n
    }

    /// `block (m x n) = lhs (m x k) x rhs (k x n)`, or `+=` with `accumulate`: [`product`]
    /// written into these columns, the same values.
    pub fn product(
        &mut self,
        lhs: Mat<T>,
        rhs: Mat<T>,
        k: usize,
        accumulate: bool,
        threads: bool,
    ) -> Result<()> {
        let (m, n) = (self.m, self.n);
        if !lhs.fits(m, k) || !rhs.fits(k, n) {
            candle_core::bail!(
                "matrix product: a {m}x{k} by {k}x{n} product with {} and {} values",
                lhs.data.len(),
                rhs.data.len()
            );
        }
        // SAFETY: `column_blocks` checked that the m rows of `ldd` fit the matrix it borrows
        // mutably for as long as this block lives, and hands each block's columns to one
        // task only.
        unsafe {
            product_raw(
                self.dst,
                self.ldd,
                lhs,
                rhs,
                (m, n, k),
                T::one(),
                accumulate,
                threads,
            )
        }
    }
}

/// `dst` (`m` rows of `ldd`) cut into blocks of `width` columns (the last may be narrower),
/// `f(state, i, block i)` for each, on rayon's threads with a `state` from `init` per thread:
/// several products writing one matrix side by side (a convolution's weight gradient in parts
/// of its columns) without a buffer of their own to copy from.
pub fn column_blocks<T: GemmFloat, S>(
    dst: &mut [T],
    (m, ldd): (usize, usize),
    width: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize, ColumnBlock<'_, T>) -> Result<()> + Sync + Send,
) -> Result<()> {
    use rayon::prelude::*;
    if !holds(dst.len(), m, ldd) {
        candle_core::bail!("column blocks: {m} rows of {ldd} in {} values", dst.len());
    }
    let width = width.max(1);
    let ptr = Shared(dst.as_mut_ptr());
    (0..ldd.div_ceil(width))
        .into_par_iter()
        .map_init(init, |state, i| {
            let block = ColumnBlock {
                dst: Shared(ptr.at(i * width)),
                ldd,
                m,
                n: width.min(ldd - i * width),
                _dst: std::marker::PhantomData,
            };
            f(state, i, block)
        })
        .collect::<Result<()>>()
}
