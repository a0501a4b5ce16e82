//! Ops with a backward that is checked against finite differences.
//!
//! candle 0.11.1 ships several ops whose gradient is missing or wrong (see
//! `docs/candle-traps.md`): the fast softmax and norms have no backward at all,
//! `upsample_nearest2d` overwrites instead of accumulating, pooling scales or errors. Training code
//! in this workspace uses the ops of this crate instead, each of which has a test against f64
//! central differences in `tests/`.

pub mod activation;
pub mod add_relu;
pub mod arch;
pub mod attention;
pub mod batch_norm;
pub mod batch_norm_add;
pub mod batch_norm_pool;
pub mod batched;
pub mod conv;
mod cpu;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dropout;
mod elem;
pub mod fastmath;
pub mod gated;
pub mod gemm_blocks;
pub mod grad_tap;
pub mod gradcheck;
pub mod host;
pub mod linear;
pub mod matmul_scratch;
pub mod norm;
mod norm_affine;
pub mod op_kept;
pub mod pool;
pub mod rounding;
pub mod softmax;
pub mod threads;
pub mod upsample;
pub mod wide;

/// Whether the environment leaves an op switched on: `VAR=0` turns it off (for before-and-after
/// measurements), anything else or nothing leaves it on; read once into `cell`.
pub(crate) fn switched_on(cell: &'static std::sync::OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v != "0"))
}

/// Whether `x` runs through this crate's own kernels: always on the CPU, on CUDA for the dtypes
/// the CUDA kernels are compiled for; elsewhere the ops fall back to compositions of candle ops
/// whose backward is correct.
pub(crate) fn has_kernel(x: &candle_core::Tensor) -> bool {
    match x.device() {
        candle_core::Device::Cpu => true,
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => {
            cuda::enabled()
                && matches!(
                    x.dtype(),
                    candle_core::DType::F32 | candle_core::DType::BF16 | candle_core::DType::F16
                )
        }
        #[allow(unreachable_patterns)]
        _ => false,
    }
}
