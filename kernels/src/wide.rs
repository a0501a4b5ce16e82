//! Loops compiled for the CPU's widest vector unit, chosen when the program runs.
//!
//! The workspace builds for baseline x86-64, where a vector holds two f64 (SSE2), so batch
//! norm's f64 passes, half of a Conv4 episode's profile (#21), ran at a quarter or an eighth of
//! what the AVX2 or AVX-512 unit of the same CPU does (nominally: Zen 4 runs AVX-512 as two
//! 256-bit halves). [`run`] calls its closure inside a
//! function compiled with those features when the CPU has them; the closure, called once from
//! there, is inlined into it and vectorised with the wider registers. Values are the same bit for
//! bit: Rust never contracts a multiply and an add into an FMA on its own, and the same
//! operations in the same order round the same in any register width.

/// `body()`, compiled for AVX-512 or AVX2 where the CPU has them (`FT_WIDE_SIMD=0` keeps the
/// baseline, for before-and-after measurements). Put the loop itself inside `body`: a function
/// it calls that is not inlined runs as the baseline compiled it.
#[inline(always)]
pub fn run<R>(body: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        match level() {
            // SAFETY: `level` found the features these functions are compiled with.
            Level::Avx512 => return unsafe { avx512(body) },
            Level::Avx2 => return unsafe { avx2(body) },
            Level::Baseline => {}
        }
    }
    body()
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq, Eq)]
enum Level {
    Baseline,
    Avx2,
    Avx512,
}

/// The widest unit the CPU has, read once.
#[cfg(target_arch = "x86_64")]
fn level() -> Level {
    #[cfg(test)]
    match tests::FORCED.load(std::sync::atomic::Ordering::Relaxed) {
        1 => return Level::Baseline,
        2 => return Level::Avx2,
        3 => return Level::Avx512,
        _ => {}
    }
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        if !crate::switched_on(&ON, "FT_WIDE_SIMD") {
            Level::Baseline
        } else if avx512_usable() {
            Level::Avx512
        } else if is_x86_feature_detected!("avx2") {
            Level::Avx2
        } else {
            Level::Baseline
        }
    })
}

/// Whether the CPU has every feature [`avx512`] is compiled with: `avx512f` turns on `avx2`,
/// `fma` and `f16c` with it in rustc, so all four are asked for.
#[cfg(target_arch = "x86_64")]
fn avx512_usable() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The name of the unit [`run`] compiles for on this CPU, for bench headers.
pub fn unit() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        match level() {
            Level::Avx512 => return "AVX-512",
            Level::Avx2 => return "AVX2",
            Level::Baseline => {}
        }
    }
    "baseline"
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn avx512<R>(body: impl FnOnce() -> R) -> R {
    body()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2<R>(body: impl FnOnce() -> R) -> R {
    body()
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use std::sync::atomic::{AtomicU8, Ordering};

    use candle_core::{DType, Device, Var};

    use crate::activation::{gelu_erf, gelu_tanh, silu, Activation};
    use crate::batch_norm::batch_norm_train;
    use crate::batch_norm_pool::{batch_norm_relu_max_pool_train, MaxPool};
    use crate::gated::{gated, gated_halves};
    use crate::gradcheck::random_tensor;
    use crate::norm::group_norm_act;

    /// The level [`super::level`] returns in this crate's unit tests: 0 the CPU's, 1 baseline,
    /// 2 AVX2, 3 AVX-512. Other tests running meanwhile get the same values either way.
    pub(super) static FORCED: AtomicU8 = AtomicU8::new(0);

    /// Batch norm (alone, and with ReLU and three max pools), group norm + SiLU, SiLU,
    /// GELU-tanh, the exact GELU, GEGLU and T5's gated GELU forward and backward: every output
    /// and gradient's bits, at one level.
    fn bits_at(level: u8) -> candle_core::Result<Vec<Vec<u32>>> {
        FORCED.store(level, Ordering::Relaxed);
        let dev = Device::Cpu;
        // 9 x 11 planes: a remainder after the sums' lanes of 8.
        let t = |dims: &[usize], seed: u64, scale: f64, shift: f64| {
            Var::from_tensor(
                &random_tensor(dims, seed, &dev)?
                    .affine(scale, shift)?
                    .to_dtype(DType::F32)?,
            )
        };
        let (x, w, b) = (
            t(&[6, 5, 9, 11], 1, 1.5, 0.3)?,
            t(&[5], 2, 0.2, 1.0)?,
            t(&[5], 3, 0.2, 0.0)?,
        );
        let (y1, _) = batch_norm_train(&x, &w, &b, 1e-5)?;
        let (y2, _) = batch_norm_relu_max_pool_train(&x, &w, &b, 1e-5, MaxPool::square(2, 2, 0))?;
        // The ResNet stem's pool and a stride-1 one: the row-at-a-time max loop's two arms.
        let (y3, _) = batch_norm_relu_max_pool_train(&x, &w, &b, 1e-5, MaxPool::square(3, 2, 1))?;
        let (y4, _) = batch_norm_relu_max_pool_train(&x, &w, &b, 1e-5, MaxPool::square(2, 1, 0))?;
        // Group norm + SiLU (one op, its loops wide), one group holding all channels.
        let y5 = group_norm_act(&x, 1, Some(&w), Some(&b), 1e-5, Activation::Silu)?;
        // The activations of the wide loops, on more values than a chunk of rayon's, with
        // their own input, so that its gradient is theirs alone.
        let long = Var::from_tensor(&x.as_tensor().flatten_all()?.repeat(60)?)?;
        let long = long.as_tensor();
        let (a1, a2, a3) = (silu(long)?, gelu_tanh(long)?, gelu_erf(long)?);
        // GEGLU over rows of two halves of 55 (a remainder after 16 lanes), and T5's form.
        let a4 = gated_halves(&long.reshape((1620, 110))?, Activation::GeluErf)?;
        let a5 = gated(long, &long.cos()?, Activation::GeluTanh)?;
        let loss = ((y1.sqr()?.sum_all()? * 0.5)?
            + (y2.sin()?.sum_all()?)
            + (y3.cos()?.sum_all()?)
            + (y4.sin()?.sum_all()?)
            + (y5.cos()?.sum_all()?)
            + (a1.sin()?.sum_all()? + a2.cos()?.sum_all()?)?
            + (a3.sin()?.sum_all()? + a4.cos()?.sum_all()? + a5.sin()?.sum_all()?)?)?;
        let grads = loss.backward()?;
        let mut out = vec![y1, y2, y3, y4, y5, a1, a2, a3, a4, a5];
        for v in [x.as_tensor(), w.as_tensor(), b.as_tensor(), long] {
            out.push(
                grads
                    .get(v)
                    .cloned()
                    .ok_or_else(|| candle_core::Error::Msg("no grad".into()))?,
            );
        }
        FORCED.store(0, Ordering::Relaxed);
        out.iter()
            .map(|t| {
                Ok(t.flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|v| v.to_bits())
                    .collect())
            })
            .collect()
    }

    #[test]
    fn wider_units_give_the_baselines_bits() -> candle_core::Result<()> {
        let want = bits_at(1)?;
        let mut levels = vec![];
        if is_x86_feature_detected!("avx2") {
            levels.push(2);
        }
        if super::avx512_usable() {
            levels.push(3);
        }
        if levels.is_empty() {
            eprintln!("this CPU has neither AVX2 nor AVX-512: only the baseline ran");
        }
        let names = [
            "batch norm",
            "batch norm + ReLU + pool",
            "batch norm + ReLU + 3x3 stride-2 pool",
            "batch norm + ReLU + 2x2 stride-1 pool",
            "group norm + SiLU",
            "SiLU",
            "GELU-tanh",
            "exact GELU",
            "GEGLU",
            "T5's gated GELU-tanh",
            "the input's gradient",
            "the weight's gradient",
            "the bias's gradient",
            "the activations' input's gradient",
        ];
        for level in levels {
            for ((got, want), name) in bits_at(level)?.iter().zip(&want).zip(names) {
                assert!(
                    got == want,
                    "level {level}: {name} differs from the baseline"
                );
            }
        }
        Ok(())
    }
}
