//! bitsandbytes' blockwise 8-bit quantization: the dynamic map, the nearest code, a block
//! quantized against its absolute maximum.

use std::sync::OnceLock;

/// bitsandbytes' dynamic quantization map (`create_dynamic_map`, 7 exponent bits, 8 bits): for
/// each decade 10^-6 .. 10^0 a linear run of fraction values, mirrored when `signed`, plus 0 and
/// 1; 256 values in ascending order.
pub fn dynamic_map(signed: bool) -> [f32; 256] {
    let (max_exp, non_sign_bits) = (7i32, 7i32);
    let mut data: Vec<f64> = Vec::with_capacity(256);
    for i in 0..max_exp {
        let items = if signed {
            2usize.pow((i + non_sign_bits - max_exp) as u32) + 1
        } else {
            2usize.pow((i + non_sign_bits - max_exp + 1) as u32) + 1
        };
        // The decade as an f32 scalar times f32 means, as torch multiplies them.
        let scale = 10f64.powi(-(max_exp - 1) + i) as f32;
        // linspace(0.1, 1, items) by torch's formula (from the start for the first half, from
        // the end for the second), then the midpoints, all in f32.
        let step = (1.0f32 - 0.1f32) / (items - 1) as f32;
        let bound = |k: usize| {
            if k < items / 2 {
                0.1f32 + step * k as f32
            } else {
                1.0f32 - step * (items - 1 - k) as f32
            }
        };
        for k in 0..items - 1 {
            let mean = (bound(k) + bound(k + 1)) / 2.0;
            data.push((scale * mean) as f64);
            if signed {
                data.push((-scale * mean) as f64);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    let mut map: Vec<f32> = data.iter().map(|v| *v as f32).collect();
    map.resize(256, 0.0);
    map.sort_by(|a, b| a.total_cmp(b));
    let mut out = [0f32; 256];
    out.copy_from_slice(&map);
    out
}

pub(super) fn maps() -> &'static ([f32; 256], [f32; 256]) {
    static MAPS: OnceLock<([f32; 256], [f32; 256])> = OnceLock::new();
    MAPS.get_or_init(|| (dynamic_map(true), dynamic_map(false)))
}

/// The index of the map value nearest `x` (the lower one on a tie).
pub fn nearest(map: &[f32; 256], x: f32) -> u8 {
    let hi = map.partition_point(|c| *c < x).min(255);
    let lo = hi.saturating_sub(1);
    if (x - map[lo]).abs() <= (map[hi] - x).abs() {
        lo as u8
    } else {
        hi as u8
    }
}

/// Quantizes one block against its absolute maximum.
/// The maximum is taken over the finite values only: an inf moment (an inf gradient) is stored
/// as the map's extreme (its ratio clamped to [-1, 1], which no finite ratio leaves) and a NaN
/// as zero, so one bad element does not turn its 255 neighbours into NaN, as an inf maximum
/// would at the next step. The CUDA kernel (`adamw8bit` in ft-kernels) quantizes the same way.
pub(super) fn quantize(map: &[f32; 256], values: &[f32], codes: &mut [u8]) -> f32 {
    let max = values
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f32, |a, v| a.max(v.abs()));
    let zero = nearest(map, 0.0);
    for (c, v) in codes.iter_mut().zip(values) {
        *c = if v.is_nan() || max == 0.0 {
            zero
        } else {
            nearest(map, (v / max).clamp(-1.0, 1.0))
        };
    }
    max
}
