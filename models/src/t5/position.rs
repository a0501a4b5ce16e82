//! T5's relative position buckets, computed as transformers computes them (f32 logarithm,
//! truncation toward zero), so bucket edges agree with the reference.

/// Bucket of `relative_position` (key position minus query position).
///
/// Bidirectional (encoder): half the buckets for each sign. Causal (decoder): only non-positive
/// distances count. Within each half, the first `num_buckets / 2` distances get their own bucket
/// and larger ones share logarithmically sized buckets up to `max_distance`.
pub fn relative_position_bucket(
    relative_position: i64,
    bidirectional: bool,
    num_buckets: usize,
    max_distance: usize,
) -> u32 {
    let mut buckets = 0i64;
    let mut nb = num_buckets as i64;
    let rp = if bidirectional {
        nb /= 2;
        if relative_position > 0 {
            buckets += nb;
        }
        relative_position.abs()
    } else {
        -relative_position.min(0)
    };
    let max_exact = nb / 2;
    let bucket = if rp < max_exact {
        rp
    } else {
        let ratio = (rp as f32 / max_exact as f32).ln()
            / ((max_distance as f64 / max_exact as f64).ln() as f32)
            * (nb - max_exact) as f32;
        (max_exact + ratio as i64).min(nb - 1)
    };
    (buckets + bucket) as u32
}

/// Bucket ids of a `q_len x k_len` grid, row-major.
pub fn bucket_grid(
    q_len: usize,
    k_len: usize,
    bidirectional: bool,
    num_buckets: usize,
    max_distance: usize,
) -> Vec<u32> {
    let mut out = Vec::with_capacity(q_len * k_len);
    for q in 0..q_len {
        for k in 0..k_len {
            out.push(relative_position_bucket(
                k as i64 - q as i64,
                bidirectional,
                num_buckets,
                max_distance,
            ));
        }
    }
    out
}
