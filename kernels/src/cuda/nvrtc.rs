//! Compiling the kernel files with NVRTC at run time, once per process and architecture: a user
//! needs the driver and libnvrtc, not a toolkit.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::{CudaDevice, Result};

/// Whether `dev` takes the sm_80 build of the kernels (with the tensor-core ones).
pub(crate) fn has_mma(dev: &CudaDevice) -> bool {
    crate::arch::has_tensor_core_kernels(compute_capability(dev))
}

/// The device's compute capability, asked of the driver once per device: every launch needs it,
/// and cudarc's query also clears (and so would hide) an error recorded earlier on the context.
fn compute_capability(dev: &CudaDevice) -> Option<(i32, i32)> {
    static CC: OnceLock<Mutex<HashMap<usize, (i32, i32)>>> = OnceLock::new();
    let ctx = dev.cuda_stream().context().clone();
    let ordinal = ctx.ordinal();
    let mut cache = CC.get_or_init(Default::default).lock().ok()?;
    if let Some(cc) = cache.get(&ordinal) {
        return Some(*cc);
    }
    let cc = ctx.compute_capability().ok()?;
    cache.insert(ordinal, cc);
    Some(cc)
}

/// The virtual architecture the kernels are compiled for on `dev` (see [`crate::arch::arch_for`]).
pub fn kernel_arch(dev: &CudaDevice) -> String {
    crate::arch::arch_for(compute_capability(dev))
}

/// The kernel files, compiled as one NVRTC program in this order: the prelude first, then one
/// file per op family (each beside its launcher `.rs`). `scripts/kernel_report.py` reads this
/// list; the host emulation (`tests/emulated/harness.cc`) includes the same files.
pub const SOURCES: [(&str, &str); 14] = [
    ("prelude.cuh", include_str!("prelude.cuh")),
    ("softmax.cu", include_str!("softmax.cu")),
    ("norm.cu", include_str!("norm.cu")),
    ("upsample.cu", include_str!("upsample.cu")),
    ("pool.cu", include_str!("pool.cu")),
    ("attention.cu", include_str!("attention.cu")),
    ("attention_tc.cu", include_str!("attention_tc.cu")),
    ("adamw.cu", include_str!("adamw.cu")),
    ("adafactor.cu", include_str!("adafactor.cu")),
    ("grad_norm.cu", include_str!("grad_norm.cu")),
    ("rounding.cu", include_str!("rounding.cu")),
    ("dropout.cu", include_str!("dropout.cu")),
    ("gated.cu", include_str!("gated.cu")),
    ("norm_affine.cu", include_str!("norm_affine.cu")),
];

/// [`SOURCES`] as one program text.
fn source() -> String {
    SOURCES
        .iter()
        .map(|(_, text)| *text)
        .collect::<Vec<_>>()
        .join("\n")
}

/// The PTX of [`SOURCES`] for `arch` (`compute_80`, `compute_75`, ...), compiled by NVRTC on
/// first use and kept for the process (one entry per architecture seen, so a handful at most).
/// Below `compute_80` the tensor-core kernels compile to empty bodies that are never launched.
pub fn ptx(arch: &str) -> Result<&'static str> {
    type Cache = Mutex<HashMap<String, std::result::Result<&'static str, String>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("the NVRTC cache lock was poisoned".into()))?;
    let entry = cache.entry(arch.to_string()).or_insert_with(|| {
        let opts = CompileOptions {
            name: Some("ft_kernels.cu".into()),
            arch: Some(Box::leak(arch.to_string().into_boxed_str())),
            ..Default::default()
        };
        // cudarc panics when libnvrtc cannot be loaded: report that as an error instead.
        let text = source();
        match std::panic::catch_unwind(|| compile_ptx_with_opts(text, opts)) {
            Ok(Ok(p)) => Ok(&*Box::leak(p.to_src().into_boxed_str())),
            Ok(Err(e)) => Err(format!("{e:?}")),
            Err(_) => Err("libnvrtc could not be loaded".into()),
        }
    });
    entry.clone().map_err(|e| {
        candle_core::Error::Msg(format!(
            "NVRTC could not compile the ft-kernels CUDA source for {arch} (is libnvrtc on the \
             library path, and does it support this GPU?): {e}"
        ))
    })
}
