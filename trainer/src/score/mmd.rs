//! Maximum mean discrepancy between two sets of features (rows), with the kernels and
//! estimators KID and CMMD are defined by.
//!
//! MMD^2 = E k(x, x') + E k(y, y') - 2 E k(x, y). The unbiased estimate leaves the diagonal
//! (each sample with itself) out of the first two means, so it can be below zero when the sets
//! come from one distribution; the biased one (a V-statistic) keeps it. KID is torchmetrics'
//! unbiased estimate with a cubic polynomial kernel; CMMD is the CMMD paper's reference code:
//! a Gaussian kernel and the whole matrices' means, times 1000. Sums run in f64, rows in
//! parallel and added in row order (the same bits on any thread count): O(n^2 d) for n samples
//! of d features.

use rayon::prelude::*;

use crate::error::{Error, Result};

/// `n` feature rows of `d` values each, row after row.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    n: usize,
    d: usize,
    data: Vec<f64>,
}

impl Features {
    /// Rows of `d` values from `data` (its length a multiple of `d`).
    pub fn new(data: Vec<f64>, d: usize) -> Result<Self> {
        if d == 0 || !data.len().is_multiple_of(d) {
            return Err(Error::Invalid(format!(
                "{} feature values are not rows of {d}",
                data.len()
            )));
        }
        Ok(Features {
            n: data.len() / d,
            d,
            data,
        })
    }

    /// Rows of f32 features (what a model hands back from the device).
    pub fn from_f32(data: &[f32], d: usize) -> Result<Self> {
        Self::new(data.iter().map(|&v| v as f64).collect(), d)
    }

    pub fn rows(&self) -> usize {
        self.n
    }

    pub fn dim(&self) -> usize {
        self.d
    }

    fn row(&self, i: usize) -> &[f64] {
        &self.data[i * self.d..(i + 1) * self.d]
    }
}

/// The kernel k(x, y).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kernel {
    /// (gamma x.y + coef)^degree; KID's is degree 3, gamma 1/d, coef 1.
    Polynomial { degree: i32, gamma: f64, coef: f64 },
    /// exp(-|x - y|^2 / (2 sigma^2)); CMMD's sigma is 10.
    Gaussian { sigma: f64 },
}

impl Kernel {
    fn eval(&self, x: &[f64], y: &[f64]) -> f64 {
        match *self {
            Kernel::Polynomial {
                degree,
                gamma,
                coef,
            } => {
                let dot: f64 = x.iter().zip(y).map(|(a, b)| a * b).sum();
                (gamma * dot + coef).powi(degree)
            }
            Kernel::Gaussian { sigma } => {
                let d2: f64 = x.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum();
                (-d2 / (2.0 * sigma * sigma)).exp()
            }
        }
    }
}

/// Whether the within-set means leave out each sample's kernel with itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Estimator {
    /// Off-diagonal means (needs two samples a set); can be below zero.
    Unbiased,
    /// Whole-matrix means, diagonals included.
    Biased,
}

/// MMD^2 between the rows of `x` and of `y` under `kernel`.
pub fn mmd2(x: &Features, y: &Features, kernel: Kernel, estimator: Estimator) -> Result<f64> {
    if x.d != y.d {
        return Err(Error::Invalid(format!(
            "MMD between features of {} and of {} values",
            x.d, y.d
        )));
    }
    let least = match estimator {
        Estimator::Unbiased => 2,
        Estimator::Biased => 1,
    };
    if x.n < least || y.n < least {
        return Err(Error::Invalid(format!(
            "MMD needs at least {least} samples a set, got {} and {}",
            x.n, y.n
        )));
    }
    // Each row's sums on rayon's threads, then added in row order: rayon's own `sum` and
    // `reduce` associate the rows as its threads happen to split them, which depends on the
    // pool and on timing (the sdxl-ft demo's CMMD moved in its last digits under load).
    let within = |s: &Features| -> f64 {
        let n = s.n as f64;
        let rows: Vec<(f64, f64)> = (0..s.n)
            .into_par_iter()
            .map(|i| {
                let row: f64 = (0..s.n).map(|j| kernel.eval(s.row(i), s.row(j))).sum();
                (row, kernel.eval(s.row(i), s.row(i)))
            })
            .collect();
        let (sum, diag) = rows.iter().fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
        match estimator {
            Estimator::Unbiased => (sum - diag) / (n * (n - 1.0)),
            Estimator::Biased => sum / (n * n),
        }
    };
    let across_rows: Vec<f64> = (0..x.n)
        .into_par_iter()
        .map(|i| {
            (0..y.n)
                .map(|j| kernel.eval(x.row(i), y.row(j)))
                .sum::<f64>()
        })
        .collect();
    let across = across_rows.iter().sum::<f64>() / (x.n as f64 * y.n as f64);
    Ok(within(x) + within(y) - 2.0 * across)
}

/// KID's MMD^2 (torchmetrics' `poly_mmd`: kernel (x.y / d + 1)^3, unbiased) between real
/// features `x` and generated `y`, on the whole sets (torchmetrics averages it over random
/// subsets).
pub fn kid(x: &Features, y: &Features) -> Result<f64> {
    let kernel = Kernel::Polynomial {
        degree: 3,
        gamma: 1.0 / x.d.max(1) as f64,
        coef: 1.0,
    };
    mmd2(x, y, kernel, Estimator::Unbiased)
}

/// CMMD as the paper's reference code computes it (google-research `cmmd/distance.py`):
/// 1000 x the biased MMD^2 with a Gaussian kernel of sigma 10, on CLIP image embeddings.
pub fn cmmd(x: &Features, y: &Features) -> Result<f64> {
    Ok(1000.0 * mmd2(x, y, Kernel::Gaussian { sigma: 10.0 }, Estimator::Biased)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_sets_have_no_biased_distance_and_bad_shapes_are_named() -> Result<()> {
        let x = Features::new((0..12).map(|i| i as f64 * 0.1).collect(), 3)?;
        assert_eq!(x.rows(), 4);
        let g = Kernel::Gaussian { sigma: 1.0 };
        assert!(mmd2(&x, &x, g, Estimator::Biased)?.abs() < 1e-12);
        // The unbiased estimate of a set against itself is below zero: the diagonal is left
        // out of the within-set means, not of the cross one.
        assert!(mmd2(&x, &x, g, Estimator::Unbiased)? < 0.0);
        let y = Features::new(vec![0.0; 8], 2)?;
        let e = mmd2(&x, &y, g, Estimator::Biased).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("3 and of 2"), "{e}");
        let one = Features::new(vec![1.0, 2.0, 3.0], 3)?;
        assert!(kid(&one, &x).is_err());
        assert!(Features::new(vec![1.0; 5], 2).is_err());
        Ok(())
    }

    /// The same bits on pools of 1 to 5 threads, and on one pool again and again: the rows'
    /// sums are added in row order. With rayon's `sum`/`reduce` the association followed its
    /// split of the rows, which depends on the pool and on timing (the sdxl-ft demo's CMMD
    /// changed in its last digits with another process loading the CPU).
    #[test]
    fn the_values_do_not_depend_on_the_threads() -> Result<()> {
        let feats = |n: usize, seed: u64| {
            let mut s = seed;
            let v = (0..n * 7)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (s >> 11) as f64 / (1u64 << 53) as f64 * 3.0 - 1.5
                })
                .collect();
            Features::new(v, 7)
        };
        let (x, y) = (feats(157, 1)?, feats(131, 2)?);
        let both =
            || -> Result<(u64, u64)> { Ok((kid(&x, &y)?.to_bits(), cmmd(&x, &y)?.to_bits())) };
        let on = |threads: usize| -> Result<(u64, u64)> {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .map_err(|e| Error::Invalid(e.to_string()))?;
            pool.install(both)
        };
        let first = on(1)?;
        for threads in [2, 3, 5, 2, 3, 5] {
            assert_eq!(on(threads)?, first, "{threads} threads");
        }
        Ok(())
    }
}
