//! How the counting allocator gets memory: glibc's heap kept mapped between steps, and the
//! largest blocks as mappings of its own that it keeps, resizes and hands out again, within the
//! process's own heap peak.
//!
//! Why: a training step allocates and frees the same large buffers every step (activations,
//! their gradients, candle's zeroed gradient slots, the convolution's columns). By default glibc
//! serves a block above its mmap threshold (128 KiB, rising with what is freed to at most
//! 32 MiB) with a fresh `mmap` and unmaps it on free, and gives the top of its heap back to the
//! system, so each step faults the pages of those buffers in again: one fault per 4 KiB page,
//! each page zeroed by the kernel. A 5-shot ResNet10 episode's backward took 23-45 K minor
//! faults, a 1-shot Conv4 one's 83-90 K (`fsct_bench` prints them per phase).
//!
//! Two parts:
//! - `tune_malloc` (run at the first allocation) fixes glibc's mmap threshold at its largest,
//!   32 MiB, and stops it trimming its heap: every block up to 32 MiB comes from the heap, whose
//!   freed memory glibc splits and joins for any later size, and stays mapped.
//! - Larger blocks are this module's own anonymous mappings. A freed one is kept; a request
//!   takes a kept block of its size, else resizes the one nearest in size (`mremap`: shrinking
//!   keeps the pages in place, growing faults in only the new part), else maps a new one.
//!
//! The bound, so that resident memory does not grow: a block is kept only while the bytes live
//! plus the bytes kept stay at or under the highest live bytes the process has reached (its
//! exact heap peak so far, memory it has had resident already); a request first gives back kept
//! blocks, oldest first, until the new block fits under that mark too, and so does a request
//! glibc serves that takes live + kept over it. glibc's own free heap is outside the bound (with
//! trimming off it keeps what it has held).
//!
//! The live-byte count is unchanged: a kept block is not live. `FT_ALLOC_CACHE=0` turns both
//! parts off, for before-and-after measurements; the switch is read once, at the first
//! allocation. Linux only (glibc's `mallopt`, `mremap`); elsewhere the system allocator alone.

use std::alloc::Layout;
use std::sync::atomic::{AtomicU8, Ordering};

/// Blocks larger than this are this module's mappings: glibc maps them itself whatever its
/// threshold (32 MiB is the largest it takes).
pub const MAPPED_ABOVE: usize = 32 << 20;
/// Mappings are page-aligned; a request aligned beyond that goes to the system allocator.
const PAGE: usize = 4096;

/// 0: not decided, 1: deciding (one thread reads the switch), 2: on, 3: off.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Whether the cache is on; the first call (the process's first allocation) reads
/// `FT_ALLOC_CACHE` and tunes glibc. Reading the variable allocates small strings, which come
/// back here and see "deciding" (off, and small blocks are the system's either way). A large
/// request from another thread meanwhile (`wait`) waits for the answer, so that a block is
/// freed by whoever allocated it.
pub(super) fn enabled(wait: bool) -> bool {
    loop {
        match STATE.load(Ordering::Acquire) {
            2 => return true,
            3 => return false,
            1 if !wait => return false,
            1 => std::hint::spin_loop(),
            _ => {
                if STATE
                    .compare_exchange(0, 1, Ordering::Acquire, Ordering::Acquire)
                    .is_err()
                {
                    continue;
                }
                let on = cfg!(target_os = "linux")
                    && std::env::var_os("FT_ALLOC_CACHE").is_none_or(|v| v != "0");
                if on {
                    tune_malloc();
                }
                STATE.store(if on { 2 } else { 3 }, Ordering::Release);
                return on;
            }
        }
    }
}

/// glibc: blocks up to 32 MiB from the heap, freed memory kept mapped.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets allocator parameters; it may run at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MAPPED_ABOVE as libc::c_int);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
        // Grow the heap in larger steps: fewer `brk` calls; untouched pages cost nothing.
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// The page-rounded size of a block this module serves, or `None` for one the system allocator
/// serves. Decided from the layout alone (once the switch is), so that a block is freed by
/// whoever allocated it.
pub(super) fn handles(layout: Layout) -> Option<usize> {
    let large = layout.size() > MAPPED_ABOVE && layout.align() <= PAGE;
    if !enabled(large) || !large {
        return None;
    }
    layout.size().checked_add(PAGE - 1).map(|s| s / PAGE * PAGE)
}

#[cfg(target_os = "linux")]
mod mapped;
#[cfg(target_os = "linux")]
pub use mapped::kept_bytes;
#[cfg(target_os = "linux")]
pub(super) use mapped::{alloc, dealloc, keep_under_peak, realloc};

/// Elsewhere [`handles`] serves nothing.
#[cfg(not(target_os = "linux"))]
mod unmapped {
    pub(in crate::ledger) unsafe fn alloc(_: usize, _: usize, _: bool) -> *mut u8 {
        std::ptr::null_mut()
    }
    pub(in crate::ledger) unsafe fn dealloc(_: *mut u8, _: usize, _: usize) {}
    pub(in crate::ledger) unsafe fn realloc(
        _: *mut u8,
        _: (usize, usize),
        _: (usize, usize),
    ) -> *mut u8 {
        std::ptr::null_mut()
    }
    pub(in crate::ledger) fn keep_under_peak() {}
    /// Bytes kept: none.
    pub fn kept_bytes() -> usize {
        0
    }
}
#[cfg(not(target_os = "linux"))]
pub use unmapped::kept_bytes;
#[cfg(not(target_os = "linux"))]
pub(super) use unmapped::{alloc, dealloc, keep_under_peak, realloc};
