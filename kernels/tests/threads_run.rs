//! `threads::run` (its own test binary: it builds rayon's global pool): the work runs on one
//! of the pool's threads, whose stack holds what a main thread's does and more.

/// Recursion `levels` deep with 64 KiB of stack a level.
fn deep(levels: usize) -> usize {
    let mut frame = [0u8; 64 << 10];
    frame[levels % frame.len()] = levels as u8;
    let frame = std::hint::black_box(frame);
    if levels == 0 {
        return frame[0] as usize;
    }
    deep(levels - 1) + frame[levels % frame.len()] as usize
}

/// The tests one at a time: `settle` writes the environment, which is sound only while no
/// other thread reads it.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn run_works_on_a_pool_thread_with_a_deep_stack() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let main = std::thread::current().id();
    let (on_pool, other_thread, _) = ft_kernels::threads::run(|| {
        (
            rayon::current_thread_index().is_some(),
            std::thread::current().id() != main,
            // 24 MiB of stack: past a main thread's 8 MiB and Rust's 2 MiB for its threads.
            deep(384),
        )
    });
    assert!(on_pool && other_thread);
}

/// Nanoseconds on the CPU of this process's threads named `name` (`/proc/self/task/*/comm`,
/// the first field of their `schedstat`); `None` where /proc cannot tell.
fn cpu_ns_of(name: &str) -> Option<u64> {
    let mut total = None;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = task.ok()?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
        if comm.trim() == name {
            let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
            let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
            total = Some(total.unwrap_or(0) + ns);
        }
    }
    total
}

/// After `run` (which settles the threads) candle's own pool threads sleep as soon as an op's
/// part is done: summed over ten 10 ms sleeps each after an add of 1M values (split over the
/// pool), its first thread spends under a millisecond on the CPU. With candle's default spin
/// (25,000 rounds before sleeping) it spent 2.55 ms in all on the 2-core development VM, on a
/// core the next op's threads need.
#[test]
fn candle_pool_threads_sleep_when_their_part_is_done() {
    use candle_core::{Device, Tensor};
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    ft_kernels::threads::run(|| {
        assert_eq!(
            std::env::var(ft_kernels::threads::SPIN_LIMIT).as_deref(),
            Ok("0")
        );
        let a = Tensor::ones(1 << 20, candle_core::DType::F32, &Device::Cpu).unwrap();
        // The pool is made at the first large op.
        let _ = (&a + &a).unwrap();
        let Some(_) = cpu_ns_of("candle-bp-0") else {
            // One core (no pool thread) or no per-thread schedstat: nothing spins, or nothing
            // to read.
            eprintln!("no candle-bp-0 thread with a readable schedstat: not checked");
            return;
        };
        let mut idle_ns = 0;
        for _ in 0..10 {
            let _ = (&a + &a).unwrap();
            let before = cpu_ns_of("candle-bp-0").unwrap_or(0);
            std::thread::sleep(std::time::Duration::from_millis(10));
            idle_ns += cpu_ns_of("candle-bp-0").unwrap_or(0) - before;
        }
        assert!(
            idle_ns < 1_000_000,
            "candle's pool thread spent {idle_ns} ns on the CPU between ops"
        );
    });
}
