//! fp32 -> bf16 with stochastic rounding.
//!
//! Round-to-nearest loses every update smaller than half a bf16 step (1/512 of the weight), so
//! pure-bf16 training stalls at small learning rates. Stochastic rounding rounds up with
//! probability equal to the distance to the lower neighbour: the expected stored value is the
//! fp32 value, and small updates survive on average. The random bits come from a counter-based
//! hash of (seed, element index), so the CPU and CUDA versions give the same bits.

use candle_core::{DType, Result, Tensor};

/// splitmix64's finaliser on `seed + (i + 1) * golden`: output `i` of a splitmix64 stream whose
/// state starts at `seed`, computed without the `i` outputs before it (as `rand_u64` in
/// prelude.cuh). Stochastic rounding and dropout draw their bits from it, so a GPU gives the
/// CPU's bits for a seed.
pub fn rand_u64(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add((i.wrapping_add(1)).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The upper 32 bits of [`rand_u64`] (as `rand_bits` in prelude.cuh).
pub fn rand_bits(seed: u64, i: u64) -> u32 {
    (rand_u64(seed, i) >> 32) as u32
}

/// The bf16 bits of `v` rounded stochastically with the random bits `r`: add 16 random bits
/// below bf16's last place and truncate. Inf and NaN round to nearest.
pub fn bf16_bits_stochastic(v: f32, r: u32) -> u16 {
    let u = v.to_bits();
    if u & 0x7fff_ffff >= 0x7f80_0000 {
        return half::bf16::from_f32(v).to_bits();
    }
    (u.wrapping_add(r & 0xffff) >> 16) as u16
}

/// Rounds `x` to bf16 stochastically (on its device; CPU and CUDA give the same bits for the
/// same seed).
pub fn round_stochastic_bf16(x: &Tensor, seed: u64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return crate::cuda::round_stochastic_bf16(&x, seed);
    }
    let v: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let out: Vec<half::bf16> = v
        .iter()
        .enumerate()
        .map(|(i, &f)| half::bf16::from_bits(bf16_bits_stochastic(f, rand_bits(seed, i as u64))))
        .collect();
    Tensor::from_vec(out, x.shape(), x.device())
}
