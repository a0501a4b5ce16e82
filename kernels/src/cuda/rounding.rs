//! fp32 -> bf16 with stochastic rounding (`rounding.cu`): the counter-based hash of
//! `crate::rounding`, so a GPU gives the CPU's bits for a seed.
//!
//! - CPU reference: `crate::rounding` (`bf16_bits_stochastic`, `rand_bits`).
//! - GPU check: `tests/cuda/optim.rs` (`stochastic_rounding_matches_the_cpu`); logic without a
//!   GPU: `tests/emulated` (`stochastic_case`).
//! - Timing: `cargo run --release --features cuda -p ft-kernels --example time_rounding`.

use candle_core::{bail, DType, Result, Tensor};

use super::launch::{device_of, elem_grid, into_tensor, launch, out_ptr, output, tensor_ptr, Arg};

/// fp32 -> bf16 with stochastic rounding on CUDA (see [`crate::rounding`] for the rule).
pub fn round_stochastic_bf16(x: &Tensor, seed: u64) -> Result<Tensor> {
    if x.dtype() != DType::F32 {
        bail!("round_stochastic_bf16 takes f32, got {:?}", x.dtype());
    }
    let x = x.contiguous()?;
    let dev = device_of(&x)?;
    let n = x.elem_count();
    let out = output(&dev, DType::BF16, n)?;
    launch(
        &dev,
        "round_stochastic_bf16",
        (elem_grid(n), 1),
        256,
        &[
            Arg::Ptr(tensor_ptr(&x)?),
            Arg::Ptr(out_ptr(&out)?),
            Arg::I64(n as i64),
            Arg::U64(seed),
        ],
    )?;
    Ok(into_tensor(out, x.shape()))
}
