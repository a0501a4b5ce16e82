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

#[test]
fn run_works_on_a_pool_thread_with_a_deep_stack() {
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
