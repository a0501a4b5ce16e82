//! Shared by the memory crate's tests (included with `mod common;`).

use candle_core::{DType, Result, Tensor};

/// The bit patterns of a tensor's values widened to f32 (exact for bf16 and f16), flattened:
/// for tests that two paths give the same bits, not merely close values.
pub fn bits(t: &Tensor) -> Result<Vec<u32>> {
    let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    Ok(v.iter().map(|x| x.to_bits()).collect())
}
