//! The large blocks' own mappings: kept after a free, resized with `mremap` for a new size.

use std::sync::Mutex;

use crate::ledger::alloc::{add, highest_bytes, live_bytes, sub};

/// How many blocks are kept at most (fixed storage: the allocator cannot allocate here).
const SLOTS: usize = 64;

/// Kept mappings, oldest first.
struct Kept {
    size: [usize; SLOTS],
    addr: [usize; SLOTS],
    len: usize,
    bytes: usize,
}

static KEPT: Mutex<Kept> = Mutex::new(Kept {
    size: [0; SLOTS],
    addr: [0; SLOTS],
    len: 0,
    bytes: 0,
});

fn lock() -> std::sync::MutexGuard<'static, Kept> {
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

impl Kept {
    /// Removes slot `i`, keeping the order.
    fn remove(&mut self, i: usize) -> (usize, usize) {
        let out = (self.size[i], self.addr[i]);
        self.size.copy_within(i + 1..self.len, i);
        self.addr.copy_within(i + 1..self.len, i);
        self.len -= 1;
        self.bytes -= out.0;
        out
    }

    fn push(&mut self, size: usize, addr: usize) {
        let n = self.len;
        self.size[n] = size;
        self.addr[n] = addr;
        self.len += 1;
        self.bytes += size;
    }

    /// Unmaps the oldest kept block.
    fn evict_oldest(&mut self) {
        let (size, addr) = self.remove(0);
        // SAFETY: a kept block is a mapping of this size that no one else holds.
        unsafe { unmap(addr, size) };
    }

    /// Unmaps kept blocks, oldest first, until `live + kept + extra <= high` or none is kept.
    fn fit(&mut self, live: usize, extra: usize, high: usize) {
        while self.len > 0 && live + self.bytes + extra > high {
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
/// resized where it must be, or a new mapping, after giving back what the bound needs. Under
/// the lock the live count and the kept blocks change together, so that another thread's
/// request sees both or neither. `zeroed`: the caller gets zeros.
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
    add(bytes);
    drop(kept);
    let p = match chosen {
        None => map(size),
        Some((old, addr)) if old == size => {
            if zeroed {
                std::ptr::write_bytes(addr as *mut u8, 0, size);
            }
            addr as *mut u8
        }
        Some((old, addr)) => {
            let p = libc::mremap(addr as *mut libc::c_void, old, size, libc::MREMAP_MAYMOVE);
            if p == libc::MAP_FAILED {
                unmap(addr, old);
                map(size)
            } else {
                if zeroed {
                    // Pages past `old` are new zero pages.
                    std::ptr::write_bytes(p.cast::<u8>(), 0, old.min(size));
                }
                p.cast()
            }
        }
    };
    if p.is_null() {
        sub(bytes);
    }
    p
}

/// Keeps a freed block of `size` (a request of `bytes`), giving older ones back first where the
/// bound needs it, and counts it no longer live.
///
/// # Safety
/// `ptr` came from [`alloc`] with `size` and `bytes`, and the caller no longer uses it.
pub(in crate::ledger) unsafe fn dealloc(ptr: *mut u8, size: usize, bytes: usize) {
    let mut kept = lock();
    sub(bytes);
    let (live, high) = (live_bytes(), highest_bytes());
    if kept.len == SLOTS {
        kept.evict_oldest();
    }
    kept.fit(live, size, high);
    if live + kept.bytes + size > high {
        drop(kept);
        unmap(ptr as usize, size);
        return;
    }
    kept.push(size, ptr as usize);
}

/// Bytes kept: freed by the program, not yet given back to the system.
pub fn kept_bytes() -> usize {
    lock().bytes
}
