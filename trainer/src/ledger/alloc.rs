//! A counting global allocator: exact live and peak heap bytes of the process on CPU.
//!
//! On CPU every tensor lives on the heap, so the bytes the allocator has handed out are the
//! measured side of the ledger. A binary or test opts in with
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;
//! ```
//!
//! Without that line the counters stay at zero and [`is_active`] says so, so callers can tell
//! "nothing allocated" from "nothing measured".
//!
//! Large freed blocks are kept for reuse within the heap peak ([`super::block_cache`]); the
//! counters count what the program holds, not what is kept.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::block_cache;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// The highest `LIVE` ever (not reset): the bound of what the block cache may keep.
static HIGH: AtomicUsize = AtomicUsize::new(0);

/// The system allocator with two counters: live bytes and the high-water mark since the last
/// [`reset_peak`].
pub struct CountingAlloc;

/// Counts `bytes` more as live (the block cache calls it while it holds its lock).
#[inline]
pub(super) fn add(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
    HIGH.fetch_max(live, Ordering::Relaxed);
}

/// Counts `bytes` fewer as live.
#[inline]
pub(super) fn sub(bytes: usize) {
    LIVE.fetch_sub(bytes, Ordering::Relaxed);
}

// SAFETY: every method forwards to `System`, or, for a layout `block_cache::handles` takes (a
// pure function of the layout once decided), to the block cache's own mappings of the size it
// gives; the counters are side effects that do not touch the memory.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.allocate(layout, false)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.allocate(layout, true)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match block_cache::handles(layout) {
            Some(size) => block_cache::dealloc(ptr, size, layout.size()),
            None => {
                System.dealloc(ptr, layout);
                sub(layout.size());
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
        match (
            block_cache::handles(layout),
            block_cache::handles(new_layout),
        ) {
            (None, None) => {
                let p = System.realloc(ptr, layout, new_size);
                if !p.is_null() {
                    if new_size >= layout.size() {
                        add(new_size - layout.size());
                        block_cache::keep_under_peak();
                    } else {
                        sub(layout.size() - new_size);
                    }
                }
                p
            }
            (Some(old), Some(new)) => {
                block_cache::realloc(ptr, (old, layout.size()), (new, new_size))
            }
            // Across the threshold: a new block, the contents copied, the old one freed.
            _ => {
                let p = self.allocate(new_layout, false);
                if !p.is_null() {
                    std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                    self.dealloc(ptr, layout);
                }
                p
            }
        }
    }
}

impl CountingAlloc {
    /// `alloc` or `alloc_zeroed`, through the block cache where it handles the layout.
    unsafe fn allocate(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        let p = match block_cache::handles(layout) {
            // Counted by the cache, under its lock.
            Some(size) => block_cache::alloc(size, layout.size(), zeroed),
            None => {
                let p = if zeroed {
                    System.alloc_zeroed(layout)
                } else {
                    System.alloc(layout)
                };
                if !p.is_null() {
                    add(layout.size());
                    block_cache::keep_under_peak();
                }
                p
            }
        };
        if !p.is_null() {
            ACTIVE.store(true, Ordering::Relaxed);
        }
        p
    }
}

/// Bytes currently allocated through [`CountingAlloc`].
pub fn live_bytes() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// Highest [`live_bytes`] seen since the process started or the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Highest [`live_bytes`] since the process started (never reset): what the block cache may
/// fill up to with the blocks it keeps.
pub fn highest_bytes() -> usize {
    HIGH.load(Ordering::Relaxed)
}

/// Starts a new high-water mark at the current live bytes, so a phase's own peak can be read.
pub fn reset_peak() -> usize {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

/// True once [`CountingAlloc`] has served an allocation, i.e. it is the global allocator.
pub fn is_active() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Runs `f` and returns its result with the peak bytes it added above the live bytes at its start.
///
/// Other threads' allocations count too; tests that compare peaks run their work on one thread.
pub fn measure_peak<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = reset_peak();
    let out = f();
    let peak = peak_bytes().saturating_sub(start);
    (out, peak)
}

/// Runs `body` holding `lock`, on a thread of its own that has ended, its thread-locals freed,
/// before the lock is released; returns what `body` returns and passes its panic on.
///
/// Why: the counters are process-wide, so tests that read them take turns on a lock. But a
/// thread's thread-locals are freed after its test function returns, when the lock is already
/// released: gemm's 2 MiB matmul slab (made by the first product on a thread, and by
/// [`super::Ledger::set_baseline`]) then comes off the live count inside the next test's window.
/// A CI run read a 4 MiB buffer between a baseline and a mark as 2 MiB.
pub fn alone<T: Send>(lock: &std::sync::Mutex<()>, body: impl FnOnce() -> T + Send) -> T {
    let _turn = lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    // A join handle's `join` waits for the thread to exit (thread-locals included); the scope's
    // own end waits only for the body, so the handle is joined here.
    std::thread::scope(|scope| match scope.spawn(body).join() {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}
