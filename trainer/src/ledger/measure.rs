//! Measured memory of a device: what the ledger compares its told bytes against.

use candle_core::Device;

use super::alloc;

/// One reading of a device's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reading {
    /// Bytes in use now.
    pub live: u64,
    /// Highest bytes in use since the previous reading, where the device can tell (CPU through the
    /// counting allocator); otherwise equal to `live`.
    pub peak: u64,
}

/// Reads memory in use on `device` and starts a new peak window.
///
/// CPU: the counting global allocator (exact heap bytes, zero when it is not installed).
/// CUDA: the bytes candle holds in the device's stream-ordered memory pool (every tensor is
/// allocated there with `cuMemAllocAsync`) and the pool's high-water mark since the previous
/// reading, the equivalents of PyTorch's `memory_allocated` / `max_memory_allocated`. Where the
/// device has no memory pool, the driver's used memory (total - free, other processes included)
/// with `peak == live`.
pub fn read(device: &Device) -> Reading {
    match device {
        Device::Cpu => {
            let peak = alloc::peak_bytes() as u64;
            let live = alloc::reset_peak() as u64;
            Reading {
                live,
                peak: peak.max(live),
            }
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => cuda_pool::read(d),
        #[allow(unreachable_patterns)]
        _ => Reading::default(),
    }
}

/// True when [`read`] gives real numbers for `device` (on CPU: the counting allocator is installed).
pub fn is_measured(device: &Device) -> bool {
    match device {
        Device::Cpu => alloc::is_active(),
        _ => cfg!(feature = "cuda"),
    }
}

/// Bytes in use on `device` now (CPU when `None`), without touching the peak window.
pub fn read_live(device: Option<&Device>) -> u64 {
    match device {
        None | Some(Device::Cpu) => alloc::live_bytes() as u64,
        #[cfg(feature = "cuda")]
        Some(Device::Cuda(d)) => cuda_pool::live(d),
        #[allow(unreachable_patterns)]
        Some(_) => 0,
    }
}

/// What the device's allocator knows, for an out-of-memory report: on CUDA the pool's used and
/// reserved bytes and the device's free and total memory; `None` on the CPU (the ledger's
/// table says it all there).
pub fn allocator_summary(device: &Device) -> Option<String> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => Some(cuda_pool::summary(d)),
        _ => None,
    }
}

#[cfg(feature = "cuda")]
mod cuda_pool {
    //! candle allocates through cudarc's `CudaStream::alloc`, which uses `cuMemAllocAsync` from
    //! the device's default memory pool when the device supports it: the pool's own counters are
    //! then the exact bytes of live tensors and their peak, with no polling.

    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::cuda_backend::CudaDevice;

    use super::Reading;

    fn pool(d: &CudaDevice) -> Option<sys::CUmemoryPool> {
        let stream = d.cuda_stream();
        let ctx = stream.context();
        if !ctx.has_async_alloc() {
            return None;
        }
        // Frees are stream-ordered: wait for them so the counters are current.
        stream.synchronize().ok()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: plain driver query with a valid device handle and an out pointer.
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(pool)
    }

    fn attr(pool: sys::CUmemoryPool, a: sys::CUmemPool_attribute) -> Option<u64> {
        let mut v: u64 = 0;
        // SAFETY: the USED_MEM_* attributes are cuuint64_t values written to `v`.
        let r = unsafe { sys::cuMemPoolGetAttribute(pool, a, &mut v as *mut u64 as *mut _) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
    }

    fn driver_used(d: &CudaDevice) -> u64 {
        d.cuda_stream()
            .context()
            .mem_get_info()
            .map(|(free, total)| (total - free) as u64)
            .unwrap_or(0)
    }

    /// Live bytes and the peak since the last call, then a new peak window.
    pub(super) fn read(d: &CudaDevice) -> Reading {
        use sys::CUmemPool_attribute::*;
        let Some(pool) = pool(d) else {
            let used = driver_used(d);
            return Reading {
                live: used,
                peak: used,
            };
        };
        let live = attr(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT).unwrap_or(0);
        let peak = attr(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH).unwrap_or(live);
        let mut zero: u64 = 0;
        // SAFETY: resetting the high-water mark takes a cuuint64_t zero.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut zero as *mut u64 as *mut _,
            );
        }
        Reading {
            live,
            peak: peak.max(live),
        }
    }

    pub(super) fn summary(d: &CudaDevice) -> String {
        use sys::CUmemPool_attribute::*;
        let fmt = |b: u64| ft_params::bytes::format_bytes(b as i64);
        let device = match d.cuda_stream().context().mem_get_info() {
            Ok((free, total)) => {
                format!("device: {} free of {}", fmt(free as u64), fmt(total as u64))
            }
            Err(e) => format!("device: free memory unknown ({e})"),
        };
        let read = |p, a| attr(p, a).map_or_else(|| "unknown".to_string(), fmt);
        match pool(d) {
            Some(p) => format!(
                "memory pool: {} used, {} reserved; {device}",
                read(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
                read(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            ),
            None => format!("no memory pool; {device}"),
        }
    }

    pub(super) fn live(d: &CudaDevice) -> u64 {
        match pool(d) {
            Some(p) => attr(
                p,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            )
            .unwrap_or(0),
            None => driver_used(d),
        }
    }
}

/// Makes the CPU matrix multiply's per-thread scratch exist now. gemm (under candle's CPU
/// matmul and convolution) gives every thread that multiplies a slab the size of its L2 cache,
/// kept for the life of the thread: on a 2-core VM with 2 MiB of L2, 6 MiB for the calling thread
/// and rayon's two. Made before the ledger's baseline, the slabs are the process's fixed cost, as
/// the CUDA context is on a GPU, instead of appearing in whichever phase multiplies first (a t5-ft
/// run's first forward, sdxl-ft's cache build) and counting against the plan there. The product
/// that makes them takes gemm's slab path under its AVX2 and its AVX-512 kernels alike
/// ([`ft_kernels::matmul_scratch`]).
pub fn warm_matmul_scratch() {
    ft_kernels::matmul_scratch::warm_all_threads();
}
