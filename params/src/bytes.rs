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

/// A byte size as people write it: `300MiB`, `24GiB`, `1.5 GB`, `4096` (bytes). Binary units
/// (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) of 1000; `K`, `M`,
/// `G` and `T` alone are read as binary, as `nvidia-smi` and most users mean them.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 300MiB, 24GiB, 1.5GB or 4096)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "`{s}`: unknown unit `{other}` (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
            ))
        }
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("`{s}` is not a positive size"));
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("300MiB"), Ok(300 << 20));
        assert_eq!(parse_bytes("24 GiB"), Ok(24 << 30));
        assert_eq!(parse_bytes("24G"), Ok(24 << 30));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("12 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_bytes("MiB").is_err());
    }
}
