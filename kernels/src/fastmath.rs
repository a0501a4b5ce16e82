//! `exp`, `tanh` and `erf` in f32 without a libm call, so that the activations' loops vectorise.
//!
//! glibc's `expf`/`tanhf` are accurate but each is a call per element, which keeps the
//! compiler from vectorising the loop around it: in the profile of t5-ft's demo `tanhf` and
//! the `expm1f` under it were about a seventh of the step (docs/benchmarks.md, #21). These are
//! Cephes' single-precision algorithms (range reduction and a polynomial, no branch but
//! selects): within a few units in the last place of the f64 result over the whole range
//! (`tests` below), where f32 activations compare with PyTorch's to 1e-5 and better.

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 in two parts (Cephes' C1 + C2), so that `x - n ln 2` loses nothing for |n| <= 128.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1.5 x 2^23: adding it rounds an f32 of magnitude below 2^22 to an integer, to nearest.
const ROUND: f32 = 12_582_912.0;

/// e^x, to a few ulp (subnormal below -87.3, as libm's); 0 below -103.97 and +inf above
/// 88.72 as libm's, NaN for NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(-104.0, 88.722_84);
    // n = round(x log2 e), r = x - n ln 2 in [-ln2/2, ln2/2].
    let y = xc * LOG2E + ROUND;
    let n = y - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 5e-1;
    let e = p * r * r + r + 1.0;
    // n as an integer from `y`'s bits (its last ones hold n: y = 1.5 x 2^23 + n), not `as i32`,
    // whose saturation is a scalar check per lane; then 2^n in two halves, so that n =
    // -150..128 stay finite or subnormal as they should.
    let n = (y.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let (h1, h2) = (n >> 1, n - (n >> 1));
    let s1 = f32::from_bits((h1.wrapping_add(127) as u32) << 23);
    let s2 = f32::from_bits((h2.wrapping_add(127) as u32) << 23);
    let y = e * s1 * s2;
    let y = if x > 88.72284 { f32::INFINITY } else { y };
    let y = if x < -103.972_08 { 0.0 } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// tanh(x), to a few ulp: an odd polynomial below |x| = 0.625 (where `1 - 2 / (e^2x + 1)`
/// would cancel), that formula above (+-1 once e^2x is infinite).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let small =
        ((((-5.704_988_7e-3 * z + 2.063_909e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1) * z
            - 3.333_328e-1)
            * z
            * x
            + x;
    let large = (1.0 - 2.0 / (exp(2.0 * a) + 1.0)).copysign(x);
    if a < 0.625 {
        // The sign of x (x z P(z) + x makes +0 of -0).
        small.copysign(x)
    } else {
        large
    }
}

/// erf(x), to a few ulp: its odd Taylor series below |x| = 0.5, `1 - erfc(|x|)` above with
/// Numerical Recipes' erfc (`t exp(-x^2 + P(t))`, t = 1 / (1 + |x| / 2), fractional error below
/// 1.2e-7), +-1 once erfc underflows.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    // 2/sqrt(pi) (x - x^3/3 + x^5/10 - x^7/42 + x^9/216 - x^11/1320 + x^13/9360).
    let small =
        (((((((1.0 / 9360.0) * z - 1.0 / 1320.0) * z + 1.0 / 216.0) * z - 1.0 / 42.0) * z + 0.1)
            * z
            - 1.0 / 3.0)
            * z
            + 1.0)
            * x
            * std::f32::consts::FRAC_2_SQRT_PI;
    let t = 1.0 / (1.0 + 0.5 * a);
    // Plain multiplies and adds (no `mul_add`: without FMA on the baseline target that is a
    // call per value).
    let p = ((((((((0.170_872_77 * t - 0.822_152_23) * t + 1.488_515_9) * t - 1.135_204) * t
        + 0.278_868_07)
        * t
        - 0.186_288_06)
        * t
        + 0.096_784_18)
        * t
        + 0.374_091_96)
        * t
        + 1.000_023_7)
        * t
        - 1.265_512_2;
    let erfc = t * exp(p - z);
    let large = (1.0 - erfc).copysign(x);
    if a < 0.5 {
        small
    } else {
        large
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest error in units of the f32 nearest the f64 truth, over `xs`.
    fn worst_ulp(xs: impl Iterator<Item = f32>, f: fn(f32) -> f32, truth: fn(f64) -> f64) -> f64 {
        xs.map(|x| {
            let want = truth(x as f64);
            let ulp = (want as f32).abs().max(f32::MIN_POSITIVE) * f32::EPSILON;
            (f(x) as f64 - want).abs() / ulp as f64
        })
        .fold(0.0, f64::max)
    }

    fn grid(lo: f32, hi: f32, n: usize) -> impl Iterator<Item = f32> {
        (0..=n).map(move |i| lo + (hi - lo) * i as f32 / n as f32)
    }

    #[test]
    fn exp_is_within_a_few_ulp_over_its_range() {
        let worst = worst_ulp(grid(-87.0, 88.722, 400_000), exp, f64::exp);
        assert!(worst <= 2.0, "exp: {worst} ulp");
        // The top of the range stays finite, and below -87.3 the results are subnormal.
        for x in [88.5f32, 88.7, 88.722_83] {
            let want = (x as f64).exp();
            assert!(((exp(x) as f64 - want) / want).abs() < 1e-6, "exp({x})");
        }
        for x in [-90.0f32, -100.0, -103.0] {
            let want = (x as f64).exp();
            // A subnormal's spacing is 2^-149.
            assert!((exp(x) as f64 - want).abs() <= 2.0 * 1.4e-45, "exp({x})");
        }
        assert_eq!(exp(-104.0), 0.0);
        // e^x passes f32::MAX at 128 ln 2 = 88.7228390...
        assert_eq!(exp(88.722_84), f32::INFINITY);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-110.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn tanh_is_within_a_few_ulp_and_odd() {
        let worst = worst_ulp(grid(-12.0, 12.0, 400_000), tanh, f64::tanh);
        assert!(worst <= 3.0, "tanh: {worst} ulp");
        let tiny = worst_ulp(grid(-1e-3, 1e-3, 10_000), tanh, f64::tanh);
        assert!(tiny <= 2.0, "tanh near 0: {tiny} ulp");
        for x in [0.3f32, 0.625, 2.0, 9.5, 1e-30] {
            assert_eq!(tanh(-x), -tanh(x));
        }
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh(0.0), 0.0);
        assert!(tanh(-0.0).is_sign_negative());
        assert!(tanh(f32::NAN).is_nan());
    }

    #[test]
    fn erf_is_within_a_few_ulp_and_odd() {
        let f64_erf = candle_core::cpu::erf::erf_f64;
        let worst = worst_ulp(grid(-6.0, 6.0, 400_000), erf, f64_erf);
        assert!(worst <= 3.0, "erf: {worst} ulp");
        let tiny = worst_ulp(grid(-1e-3, 1e-3, 10_000), erf, f64_erf);
        assert!(tiny <= 2.0, "erf near 0: {tiny} ulp");
        for x in [0.2f32, 0.5, 1.5, 4.0, 1e-30] {
            assert_eq!(erf(-x), -erf(x));
        }
        assert_eq!(erf(f32::INFINITY), 1.0);
        assert_eq!(erf(0.0), 0.0);
        assert!(erf(f32::NAN).is_nan());
    }
}
