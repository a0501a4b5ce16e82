//! The large blocks' own mappings: kept after a free, resized with `mremap` for a new size.
//!
//! Every change to the kept blocks and the live count happens under one lock, the system calls
//! included (they allocate nothing), so another thread sees both or neither; a request's count
//! is added only once its memory is there.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use crate::ledger::alloc::{add, highest_bytes, live_bytes, sub};

/// How many blocks are kept at most (fixed storage: the allocator cannot allocate here).
const SLOTS: usize = 64;

/// Kept mappings, oldest first.
struct Kept {
    size: [usize; SLOTS],
    addr: [usize; SLOTS],
    len: usize,
}

static KEPT: Mutex<Kept> = Mutex::new(Kept {
    size: [0; SLOTS],
    addr: [0; SLOTS],
    len: 0,
});

/// The kept blocks' bytes, readable without the lock (changed only under it).
static KEPT_BYTES: AtomicUsize = AtomicUsize::new(0);

fn lock() -> MutexGuard<'static, Kept> {
    // Nothing panics while the lock is held, so a poisoned lock still holds consistent slots.
    KEPT.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A new anonymous mapping of `size` bytes (zero pages), or null.
unsafe fn map(size: usize) -> *mut u8 {
    let p = libc::mmap(
        std::ptr::null_mut(),
        size,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        -1,
        0,
    );
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p.cast()
    }
}

unsafe fn unmap(addr: usize, size: usize) {
    libc::munmap(addr as *mut libc::c_void, size);
}

/// The mapping at `addr` of `old` bytes as `new` bytes (moved where it must be; the contents
/// up to the smaller size kept, pages past `old` zero), or null with the old mapping intact.
unsafe fn resize(addr: usize, old: usize, new: usize) -> *mut u8 {
    let p = libc::mremap(addr as *mut libc::c_void, old, new, libc::MREMAP_MAYMOVE);
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p.cast()
    }
}

impl Kept {
    fn bytes(&self) -> usize {
        KEPT_BYTES.load(Ordering::Relaxed)
    }

    /// Removes slot `i`, keeping the order.
    fn remove(&mut self, i: usize) -> (usize, usize) {
        let out = (self.size[i], self.addr[i]);
        self.size.copy_within(i + 1..self.len, i);
        self.addr.copy_within(i + 1..self.len, i);
        self.len -= 1;
        KEPT_BYTES.fetch_sub(out.0, Ordering::Relaxed);
        out
    }

    fn push(&mut self, size: usize, addr: usize) {
        let n = self.len;
        self.size[n] = size;
        self.addr[n] = addr;
        self.len += 1;
        KEPT_BYTES.fetch_add(size, Ordering::Relaxed);
    }

    /// Unmaps the oldest kept block.
    fn evict_oldest(&mut self) {
        let (size, addr) = self.remove(0);
        // SAFETY: a kept block is a mapping of this size that no one else holds.
        unsafe { unmap(addr, size) };
    }

    /// Unmaps kept blocks, oldest first, until `live + kept + extra <= high` or none is kept.
    fn fit(&mut self, live: usize, extra: usize, high: usize) {
        while self.len > 0 && live + self.bytes() + extra > high {
            self.evict_oldest();
        }
    }

    /// The kept block to serve `size` with: the newest of that size, else the nearest in size,
    /// shrunk in place (its tail's pages given back) or grown (the new part faulted in).
    fn choose(&self, size: usize) -> Option<usize> {
        let slots = 0..self.len;
        if let Some(i) = slots.clone().rev().find(|&i| self.size[i] == size) {
            return Some(i);
        }
        slots.min_by_key(|&i| self.size[i].abs_diff(size))
    }
}

/// A block of `size` (page-rounded) bytes for a request of `bytes`, counted live: a kept one,
/// resized where it must be, or a new mapping, after giving back what the bound needs.
/// `zeroed`: the caller gets zeros.
///
/// # Safety
/// `size` is what [`super::handles`] returned for a layout of `bytes`.
pub(in crate::ledger) unsafe fn alloc(size: usize, bytes: usize, zeroed: bool) -> *mut u8 {
    let mut kept = lock();
    let (live, high) = (live_bytes(), highest_bytes());
    let chosen = kept.choose(size).map(|i| kept.remove(i));
    // Room for the new block (a grown or new one adds resident bytes) under the peak, or under
    // what is live with it where that is a new peak.
    kept.fit(live, size, high.max(live + size));
    // The block and how much of it may hold old contents.
    let (p, used) = match chosen {
        None => (map(size), 0),
        Some((old, addr)) if old == size => (addr as *mut u8, size),
        Some((old, addr)) => {
            let p = resize(addr, old, size);
            if p.is_null() {
                unmap(addr, old);
                (map(size), 0)
            } else {
                (p, old.min(size))
            }
        }
    };
    if !p.is_null() {
        add(bytes);
    }
    drop(kept);
    if zeroed && !p.is_null() {
        std::ptr::write_bytes(p, 0, used);
    }
    p
}

/// Keeps a freed block of `size` (a request of `bytes`), giving older ones back first where the
/// bound needs it, and counts it no longer live.
///
/// # Safety
/// `ptr` came from [`alloc`] or [`realloc`] with `size` and `bytes`, and the caller no longer
/// uses it.
pub(in crate::ledger) unsafe fn dealloc(ptr: *mut u8, size: usize, bytes: usize) {
    let mut kept = lock();
    sub(bytes);
    let (live, high) = (live_bytes(), highest_bytes());
    if live + size > high {
        // It cannot be kept under the peak whatever else is given back.
        unmap(ptr as usize, size);
        return;
    }
    if kept.len == SLOTS {
        kept.evict_oldest();
    }
    kept.fit(live, size, high);
    kept.push(size, ptr as usize);
}

/// A block of `old` bytes (a request of `old_bytes`) as one of `new` bytes (a request of
/// `new_bytes`), both sizes this module serves: resized in place or moved by `mremap`, the
/// contents kept, counted as the new request only (as glibc's `realloc` would be). Null with
/// the old block intact where it cannot.
///
/// # Safety
/// `ptr` came from [`alloc`] or [`realloc`] with `old` and `old_bytes`; `new` is what
/// [`super::handles`] returned for a layout of `new_bytes`.
pub(in crate::ledger) unsafe fn realloc(
    ptr: *mut u8,
    (old, old_bytes): (usize, usize),
    (new, new_bytes): (usize, usize),
) -> *mut u8 {
    let mut kept = lock();
    let live = live_bytes() - old_bytes;
    kept.fit(live, new, highest_bytes().max(live + new));
    let p = if new == old {
        ptr
    } else {
        resize(ptr as usize, old, new)
    };
    if !p.is_null() {
        sub(old_bytes);
        add(new_bytes);
    }
    p
}

/// Gives kept blocks back, oldest first, while live + kept bytes are over the highest live
/// bytes: a request served elsewhere (glibc's heap) can raise the live count past what the
/// kept blocks left room for. Skipped when another thread holds the lock (its own request
/// applies the bound).
pub(in crate::ledger) fn keep_under_peak() {
    let kept = KEPT_BYTES.load(Ordering::Relaxed);
    if kept == 0 || live_bytes() + kept <= highest_bytes() {
        return;
    }
    let mut kept = match KEPT.try_lock() {
        Ok(kept) => kept,
        Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(TryLockError::WouldBlock) => return,
    };
    kept.fit(live_bytes(), 0, highest_bytes());
}

/// Bytes kept: freed by the program, not yet given back to the system.
pub fn kept_bytes() -> usize {
    KEPT_BYTES.load(Ordering::Relaxed)
}
