//! Byte counts of tensors, and bytes as people read them: what the plan, the ledger and every
//! report print.

use candle_core::Tensor;

/// Bytes held by a tensor's elements (views count their full element count).
pub fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Bytes as a short human string (binary units), keeping the sign.
pub fn format_bytes(b: i64) -> String {
    let sign = if b < 0 { "-" } else { "" };
    let v = b.unsigned_abs() as f64;
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut u = 0;
    let mut x = v;
    while x >= 1024.0 && u < UNITS.len() - 1 {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{sign}{v} B")
    } else {
        format!("{sign}{x:.2} {}", UNITS[u])
    }
}
