//! One chunk's logits to its summed loss and `softmax - onehot`, a row at a time on rayon's
//! threads (CPU tensors of f32 or f64).
//!
//! Why a pass of its own rather than candle's ops: the chain (max, subtract, exp, sum, log,
//! gather, subtract, exp, scatter-add) made a [rows, vocab] tensor at most of its steps; and it
//! kept probabilities below the smallest normal float as subnormal numbers. A head that tells its
//! tokens apart has many of those (exp(-90) is one in f32), and x86 multiplies subnormal
//! operands many times slower than normal ones: on the t5-small-sized bench the step's forward
//! took 3.8-4.9 s, mostly in the two products of `softmax - onehot`, and the head alone 4.0 s
//! with spread logits against 0.4 s (docs/benchmarks.md). Here a probability
//! below the dtype's smallest normal is written as 0. What that drops from a gradient element is
//! under `1.2e-38 x |W|` per row in f32, below the rounding of any element that is not itself
//! subnormal; the test `tiny_probabilities_are_zero_and_the_rest_unchanged` pins both sides.

use rayon::prelude::*;

/// The float types the pass runs in (the chunk's logits are f32, or f64 for f64 inputs).
pub(super) trait RowFloat: candle_core::WithDType + Send + Sync {
    /// The smallest positive normal value: probabilities below it are written as 0.
    const TINY: f64;
    fn exp_minus(self, m: Self) -> Self;
    /// The larger of the two; NaN wins, so a NaN logit makes a NaN loss rather than vanishing
    /// from the row's maximum.
    fn max_of(self, other: Self) -> Self {
        #[allow(clippy::eq_op)]
        let nan = self != self;
        if nan || self > other {
            self
        } else {
            other
        }
    }
}

impl RowFloat for f32 {
    const TINY: f64 = f32::MIN_POSITIVE as f64;
    /// 0 where the result would be below f32's smallest normal: computing those subnormal
    /// values is itself slow on x86 (and every later use of them), and each is dropped from
    /// the probabilities anyway (a row's sum is at least 1, its maximum's term). Cephes' exp
    /// ([`crate::fastmath::exp`]): no libm call, so the row's loop vectorises. NaN stays NaN.
    fn exp_minus(self, m: f32) -> f32 {
        /// ln(f32::MIN_POSITIVE).
        const LN_TINY: f32 = -87.336_54;
        let d = self - m;
        let e = crate::fastmath::exp(if d < LN_TINY { LN_TINY } else { d });
        if d < LN_TINY {
            0.0
        } else {
            e
        }
    }
}

impl RowFloat for f64 {
    const TINY: f64 = f64::MIN_POSITIVE;
    fn exp_minus(self, m: f64) -> f64 {
        (self - m).exp()
    }
}

/// For `logits` [rows, vocab] (row-major) and one label per row: the summed
/// `log sum exp(row) - row[label]` in f64, and, when `grads`, `softmax(row) - onehot(label)`:
/// exponentials in `T` (f32's by [`crate::fastmath::exp`]), each row's sum and the division in
/// f64, rounded once into `T`, probabilities below `T`'s smallest normal as 0.
pub(super) fn loss_and_dlogits<T: RowFloat>(
    logits: &[T],
    vocab: usize,
    labels: &[u32],
    grads: bool,
) -> (f64, Option<Vec<T>>) {
    let vocab = vocab.max(1);
    let row_max = |row: &[T]| {
        row.iter()
            .fold(T::from_f64(f64::NEG_INFINITY), |m, &x| x.max_of(m))
    };
    // Per-row losses are summed in row order after the parallel part: the same bits on any
    // number of threads.
    let (losses, out) = if grads {
        let mut out = vec![T::zero(); logits.len()];
        let losses: Vec<f64> = out
            .par_chunks_mut(vocab)
            .zip(logits.par_chunks(vocab))
            .zip(labels.par_iter())
            .map(|((o, row), &label)| {
                let m = row_max(row);
                // Two loops, so that the exponentials' loop has no f64 sum in it to serialise.
                for (oi, &x) in o.iter_mut().zip(row) {
                    *oi = x.exp_minus(m);
                }
                let sum: f64 = o.iter().map(|e| e.to_f64()).sum();
                let inv = 1.0 / sum;
                let flushed = |p: f64| if p < T::TINY { 0.0 } else { p };
                let l = label as usize;
                let at_label = o[l].to_f64();
                for oi in o.iter_mut() {
                    *oi = T::from_f64(flushed(oi.to_f64() * inv));
                }
                // The label's `p - 1` in f64 too, rounded once.
                o[l] = T::from_f64(flushed(at_label * inv) - 1.0);
                sum.ln() - (row[l].to_f64() - m.to_f64())
            })
            .collect();
        (losses, Some(out))
    } else {
        let losses: Vec<f64> = logits
            .par_chunks(vocab)
            .zip(labels.par_iter())
            .map_init(Vec::new, |e, (row, &label)| {
                let m = row_max(row);
                e.clear();
                e.extend(row.iter().map(|&x| x.exp_minus(m)));
                let sum: f64 = e.iter().map(|e| e.to_f64()).sum();
                sum.ln() - (row[label as usize].to_f64() - m.to_f64())
            })
            .collect();
        (losses, None)
    };
    (losses.iter().sum(), out)
}
