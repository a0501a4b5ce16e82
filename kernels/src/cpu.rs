//! Shared plumbing of the CPU forward passes: dtype dispatch over contiguous row-major data.

use candle_core::{bail, CpuStorage, Layout, Result, WithDType};

/// The contiguous slice of `storage` described by `layout`, as `T`.
pub(crate) fn slice<'a, T: WithDType>(data: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => bail!("kernel input must be contiguous"),
    }
}

/// Applies `f` row by row (rows of `dim` elements) computing in f64 and writing `T`.
pub(crate) fn map_rows<T: WithDType>(
    src: &[T],
    dim: usize,
    f: &(dyn Fn(&[f64], &mut [f64]) + Sync),
) -> Vec<T> {
    use rayon::prelude::*;
    let mut out = vec![T::zero(); src.len()];
    out.par_chunks_mut(dim.max(1))
        .zip(src.par_chunks(dim.max(1)))
        .for_each(|(o, s)| {
            let x: Vec<f64> = s.iter().map(|v| v.to_f64()).collect();
            let mut y = vec![0f64; x.len()];
            f(&x, &mut y);
            for (oi, yi) in o.iter_mut().zip(y) {
                *oi = T::from_f64(yi);
            }
        });
    out
}

/// Runs a row function over any float storage.
pub(crate) fn rows(
    storage: &CpuStorage,
    layout: &Layout,
    f: &(dyn Fn(&[f64], &mut [f64]) + Sync),
) -> Result<CpuStorage> {
    let dim = layout.dims().last().copied().unwrap_or(1);
    Ok(match storage {
        CpuStorage::F32(d) => CpuStorage::F32(map_rows(slice(d, layout)?, dim, f)),
        CpuStorage::F64(d) => CpuStorage::F64(map_rows(slice(d, layout)?, dim, f)),
        CpuStorage::F16(d) => CpuStorage::F16(map_rows(slice(d, layout)?, dim, f)),
        CpuStorage::BF16(d) => CpuStorage::BF16(map_rows(slice(d, layout)?, dim, f)),
        _ => bail!("unsupported dtype for a float kernel (f32, f64, f16, bf16)"),
    })
}

/// A row's mean (0 without centring) and reciprocal standard deviation `1 / sqrt(var + eps)`
/// (the biased variance), in f64: what every norm here computes its output from, forward and
/// backward, so that the one-op norm and the separate ops agree to the bit. Summed in
/// [`LANES`] partial sums on the widest vector unit: once the norms' other loops ran wide, the
/// two sums in one chain each were half of a group norm's forward (docs/benchmarks.md).
#[inline(always)]
pub(crate) fn row_stats<T: WithDType>(x: &[T], center: bool, eps: f64) -> (f64, f64) {
    let n = x.len().max(1) as f64;
    let mean = if center {
        lane_sum(
            x,
            #[inline(always)]
            |v| v,
        ) / n
    } else {
        0.0
    };
    let var = lane_sum(
        x,
        #[inline(always)]
        |v| (v - mean) * (v - mean),
    ) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Partial sums per f64 reduction: independent chains the compiler keeps in vector registers.
/// One chain makes every add wait for the last (four cycles each), which had batch norm's sums
/// take 44% of a Conv4 episode's profile (docs/benchmarks.md, #21).
pub(crate) const LANES: usize = 8;

/// `sum(f(v))` over `xs` in f64, in [`LANES`] partial sums added at the end, on the widest
/// vector unit ([`crate::wide`]).
#[inline(always)]
pub(crate) fn lane_sum<T: WithDType>(xs: &[T], f: impl Fn(f64) -> f64) -> f64 {
    crate::wide::run(
        #[inline(always)]
        move || {
            let mut acc = [0f64; LANES];
            let mut chunks = xs.chunks_exact(LANES);
            for chunk in &mut chunks {
                for (a, v) in acc.iter_mut().zip(chunk) {
                    *a += f(v.to_f64());
                }
            }
            let tail: f64 = chunks.remainder().iter().map(|v| f(v.to_f64())).sum();
            acc.iter().sum::<f64>() + tail
        },
    )
}

/// `out[i] = src[i * stride]`: a copy for stride 1; for stride 2 (a ResNet stem's unfolding, 22
/// million values an FSCT episode, and its 3x3 stride-2 max pool's backward) in pairs, which
/// the compiler turns into vector shuffles where the indexed loop read one value at a time
/// behind a bounds check.
#[inline(always)]
pub(crate) fn gather<T: Copy>(out: &mut [T], src: &[T], stride: usize) {
    let Some(last) = out.len().checked_sub(1) else {
        return;
    };
    match stride {
        1 => out.copy_from_slice(&src[..out.len()]),
        2 => {
            let (head, tail) = out.split_at_mut(last);
            for (o, pair) in head.iter_mut().zip(src.chunks_exact(2)) {
                *o = pair[0];
            }
            tail[0] = src[last * 2];
        }
        _ => {
            for (o, v) in out.iter_mut().zip(src.iter().step_by(stride)) {
                *o = *v;
            }
        }
    }
}
