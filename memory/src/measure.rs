//! Measured memory of a device: what the ledger compares its told bytes against.

use candle_core::Device;

use crate::alloc;

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
/// CUDA: the driver's used memory (total - free), which includes the caching allocator's reserve
/// and other processes; there is no peak between readings, so `peak == live`.
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
        Device::Cuda(d) => match d.cuda_stream().context().mem_get_info() {
            Ok((free, total)) => {
                let used = (total - free) as u64;
                Reading {
                    live: used,
                    peak: used,
                }
            }
            Err(_) => Reading::default(),
        },
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
        Some(Device::Cuda(d)) => d
            .cuda_stream()
            .context()
            .mem_get_info()
            .map(|(free, total)| (total - free) as u64)
            .unwrap_or(0),
        #[allow(unreachable_patterns)]
        Some(_) => 0,
    }
}
