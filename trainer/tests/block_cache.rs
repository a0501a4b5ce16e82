//! The counting allocator's large blocks: kept after a free and handed out again (same size,
//! shrunk, grown), zeroed where asked, their contents carried through a reallocation, and never
//! more kept than the process's heap peak leaves room for.
#![cfg(target_os = "linux")]

use std::sync::Mutex;

use ft_trainer::ledger::alloc::{alone, highest_bytes, live_bytes, measure_peak, CountingAlloc};
use ft_trainer::ledger::block_cache::{kept_bytes, MAPPED_ABOVE};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The cache is process-wide: tests that read it take turns.
static TURN: Mutex<()> = Mutex::new(());

const MIB: usize = 1 << 20;

/// live + kept at or under the highest live bytes, with 1 MiB for small allocations other threads
/// (the test harness's) make between the three reads.
fn within_the_peak() {
    assert!(
        live_bytes() + kept_bytes() <= highest_bytes() + MIB,
        "live {} + kept {} over the highest live {}",
        live_bytes(),
        kept_bytes(),
        highest_bytes()
    );
}

fn switched_off() -> bool {
    std::env::var_os("FT_ALLOC_CACHE").is_some_and(|v| v == "0")
}

/// `f` in its turn, where the cache is on (a run with `FT_ALLOC_CACHE=0` skips it).
fn with_the_cache(f: impl FnOnce() + Send) {
    if !switched_off() {
        alone(&TURN, f);
    }
}

#[test]
fn a_freed_block_is_handed_out_again_zeroed_where_asked() {
    with_the_cache(|| {
        // A size no other test here uses, so the blocks chosen are this test's.
        let n = MAPPED_ABOVE + 40 * MIB;
        let mut a = vec![7u8; n];
        a[n - 1] = 9;
        let addr = a.as_ptr() as usize;
        drop(a);
        assert!(kept_bytes() >= n, "the freed block is kept");
        within_the_peak();
        // The same size again: the kept block, zeroed (calloc's promise) though it held 7s.
        let b = vec![0u8; n];
        assert_eq!(b.as_ptr() as usize, addr, "the kept block is reused");
        assert!(b.iter().all(|&x| x == 0), "alloc_zeroed gives zeros");
        within_the_peak();
        drop(b);
        // Smaller: the kept block shrunk in place, zeroed.
        let c = vec![0u8; n - 4 * MIB];
        assert_eq!(
            c.as_ptr() as usize,
            addr,
            "a larger kept block is shrunk in place"
        );
        assert!(c.iter().all(|&x| x == 0));
        drop(c);
        // Larger: grown (moved or not), zero throughout, the new part included.
        let mut d = vec![0u8; n + 16 * MIB];
        assert!(d.iter().all(|&x| x == 0));
        d.fill(3);
        assert!(d.iter().all(|&x| x == 3));
        within_the_peak();
    });
}

#[test]
fn kept_blocks_are_given_back_to_stay_within_the_peak() {
    with_the_cache(|| {
        let n = MAPPED_ABOVE + MIB;
        let (a, b) = (vec![1u8; n], vec![2u8; n]);
        let high = highest_bytes();
        drop(a);
        drop(b);
        within_the_peak();
        // A block as large as both and more: one kept block grows into it, and the other is
        // given back so that live + kept stays under the peak (or at the new one).
        let c = vec![0u8; 2 * n + 8 * MIB];
        assert!(c.iter().all(|&x| x == 0));
        within_the_peak();
        assert!(
            live_bytes() + kept_bytes() <= high.max(live_bytes()),
            "no more resident than the peak before, or what is live now"
        );
        drop(c);
        within_the_peak();
    });
}

#[test]
fn blocks_the_heap_serves_give_kept_blocks_back_too() {
    with_the_cache(|| {
        let n = MAPPED_ABOVE + 3 * MIB;
        let big = [vec![1u8; n], vec![2u8; n]];
        drop(big);
        assert!(kept_bytes() >= 2 * n);
        // Blocks of 30 MiB come from glibc's heap, past the kept blocks' room.
        let small: Vec<Vec<u8>> = (0..3).map(|i| vec![i as u8 + 1; 30 * MIB]).collect();
        within_the_peak();
        drop(small);
    });
}

#[test]
fn a_reallocation_between_large_blocks_resizes_and_keeps_the_contents() {
    alone(&TURN, || {
        let n = MAPPED_ABOVE + 2 * MIB;
        let mut v: Vec<u8> = Vec::with_capacity(n);
        v.extend((0..n).map(|i| (i % 251) as u8));
        // Grows within large blocks: resized, so the peak rises by the growth only (a new
        // block beside the old one would add the whole new size), contents kept.
        let ((), peak) = measure_peak(|| v.reserve_exact(n + 8 * MIB));
        let growth = v.capacity() - n;
        assert!(peak < growth + MIB, "peak {peak} for a growth of {growth}");
        assert!(v.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
        v.truncate(n - MIB);
        v.shrink_to_fit();
        assert!(v.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
        within_the_peak();
    });
}

#[test]
fn a_reallocation_across_the_threshold_keeps_the_contents() {
    alone(&TURN, || {
        let n = MAPPED_ABOVE - MIB;
        let mut v: Vec<u32> = (0..(n / 4) as u32).collect();
        // Grows past the threshold (into a mapping of the cache's) and back below it.
        v.extend((n / 4) as u32..(3 * n / 8) as u32);
        assert!(v.capacity() * 4 > MAPPED_ABOVE);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
        v.truncate(1024);
        v.shrink_to_fit();
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
        within_the_peak();
    });
}

#[test]
fn threads_taking_and_freeing_blocks_see_their_own_contents() {
    alone(&TURN, || {
        std::thread::scope(|s| {
            for t in 0..3u8 {
                s.spawn(move || {
                    for i in 0..6usize {
                        let n = MAPPED_ABOVE + (i % 3) * 3 * MIB + t as usize * MIB;
                        let v = vec![t + 1; n];
                        assert!(v.iter().all(|&x| x == t + 1));
                        let z = vec![0u8; n];
                        assert!(z.iter().all(|&x| x == 0));
                    }
                });
            }
        });
        within_the_peak();
    });
}

/// Run in a fresh child process by the test below: prints how many of five 20 MiB blocks,
/// held together (more than the heap's 64 MiB top pad, so the heap must grow), glibc put in
/// mappings of its own (`mallinfo2`'s mapped bytes) rather than in its heap.
#[cfg(target_env = "gnu")]
#[test]
#[ignore = "a probe that glibc_serves_blocks_up_to_32_mib_from_its_heap runs in a child"]
fn probe_20_mib_blocks() {
    // SAFETY: reads allocator statistics.
    let mapped = || unsafe { libc::mallinfo2() }.hblkhd;
    let before = mapped();
    let blocks: Vec<Vec<u8>> = (0..5).map(|_| vec![1u8; 20 * MIB]).collect();
    println!("MAPPED={}", (mapped() - before) / (20 * MIB));
    drop(blocks);
}

/// With the switch on (`mallopt` at the first allocation), a fresh process's 20 MiB blocks come
/// from glibc's heap; with it off, glibc maps each (its threshold starts at 128 KiB). In child
/// processes, so that no earlier free has moved glibc's own threshold.
#[cfg(target_env = "gnu")]
#[test]
fn glibc_serves_blocks_up_to_32_mib_from_its_heap() {
    let probe = |switch: &str| {
        let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--ignored", "--exact", "probe_20_mib_blocks", "--nocapture"])
            .arg("--test-threads=1")
            .env("FT_ALLOC_CACHE", switch)
            .output()
            .expect("the child runs");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "child failed: {text}");
        text
    };
    assert!(
        probe("1").contains("MAPPED=0\n"),
        "tuned glibc: all from the heap"
    );
    assert!(
        probe("0").contains("MAPPED=5\n"),
        "glibc as it is: a mapping each"
    );
}

/// `FT_ALLOC_CACHE=0` (read at the first allocation): nothing kept. Runs this test again in a
/// child process with the switch off.
#[test]
fn the_switch_turns_it_off() {
    if switched_off() {
        let v = vec![1u8; MAPPED_ABOVE + MIB];
        drop(v);
        assert_eq!(kept_bytes(), 0, "nothing kept with FT_ALLOC_CACHE=0");
        return;
    }
    let out = alone(&TURN, || {
        std::process::Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--exact", "the_switch_turns_it_off", "--test-threads=1"])
            .env("FT_ALLOC_CACHE", "0")
            .output()
            .expect("the child runs")
    });
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {text}");
    assert!(text.contains("1 passed"), "the child ran the test: {text}");
}
