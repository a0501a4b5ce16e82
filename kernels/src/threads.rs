//! How many threads the CPU's work uses, decided once per process.
//!
//! candle 0.11.1 asks how many threads each CPU matrix product may use
//! (`candle_core::utils::get_num_threads`) every time it runs one, and without
//! `RAYON_NUM_THREADS` in the environment the answer comes from reading and parsing
//! `/proc/cpuinfo` (its count of physical cores): thousands of reads a second on a small model.
//! The t5-ft demo spent about 8% of its samples in the kernel writing that file out and took
//! 28.2 s where the same binary with the variable set took 20.6 s (docs/benchmarks.md).
//! [`settle`] asks once and writes the answer into the variable, so that every later product
//! reads it from the environment instead.
//!
//! [`run`] then runs a binary's work on one of rayon's threads rather than on `main`'s. Every
//! parallel CPU op (candle's maps, gemm's products, this crate's passes) called from outside
//! the pool queues its job, wakes the pool and puts the calling thread to sleep until the job
//! is done: two more context switches per op, which on the demos' small tensors cost more than
//! the op. Called from a worker, the op splits into that worker's queue, the worker takes its
//! own part at once and the other threads steal the rest. The demos, release binaries with and
//! without it (docs/benchmarks.md): t5-ft 16.4-18.9 s -> 10.8-12.0 s, fewshot-ft 22.9-23.8 s ->
//! 15.4-18.9 s, 100 steps of sdxl-ft's 18.9 s -> 14.0 s.
//!
//! candle 0.11.1 splits its elementwise ops on 64K values or more (the backward's adds into
//! gradient slots among them) over a pool of its own threads (`candle-bp-N`, one fewer than the
//! cores), apart from rayon's. Each of them, its part done, spins up to
//! `CANDLE_BARRIER_POOL_SPIN_LIMIT` times (25,000 by default: about half a millisecond here)
//! before it sleeps, on a core that rayon's threads, running our ops and gemm's products right
//! after, need: on the 2-core VM 46% of the samples of a 64-channel 32x32 convolution's forward
//! and backward were that spin. [`settle`] sets the limit to 0 (the thread sleeps at once and
//! is woken for the next op) unless it is set already (docs/benchmarks.md: 10-15% off the
//! t5-small-sized and UNet steps).

/// Puts candle's answer for the matrix products' threads in `RAYON_NUM_THREADS`, after making
/// rayon's global pool at the size it takes without the variable (the logical CPUs this process
/// may use), so both keep the sizes they had, and 0 in [`SPIN_LIMIT`]; neither variable is
/// changed when it is set already. Call it
/// first thing in `main`: changing the environment is sound only while no other thread reads
/// it.
pub fn settle() {
    let given = std::env::var_os("RAYON_NUM_THREADS").is_some();
    let products = (!given).then(candle_core::utils::get_num_threads);
    // The pool at the size it takes without the variable (or the size the variable gives), its
    // threads with a main thread's stack and more: [`run`] puts a binary's whole work on one of
    // them (candle's backward walks the graph recursively). Reserved address space, not memory.
    // An error means the pool exists already.
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(STACK)
        .build_global();
    if let Some(products) = products {
        std::env::set_var("RAYON_NUM_THREADS", products.to_string());
    }
    // Read once, when candle's pool is made (its first large elementwise op, after this).
    if std::env::var_os(SPIN_LIMIT).is_none() {
        std::env::set_var(SPIN_LIMIT, "0");
    }
}

/// How many times candle's pool threads spin for the next job before they sleep (see the
/// module's note).
pub const SPIN_LIMIT: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";

/// The stack of rayon's threads: 64 MiB, eight times a main thread's usual 8 MiB (Rust's own
/// threads get 2 MiB), since [`run`] moves the whole training onto one of them.
pub const STACK: usize = 64 << 20;

/// [`settle`], then `work` on one of rayon's threads (the caller waits): what every binary's
/// `main` does. Everything `work` touches thread by thread (MPI, which must be called from the
/// thread that initialised it; thread-locals) stays on that one thread; parallel ops inside it
/// need no wake-up of the calling thread (see the module's note).
pub fn run<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    settle();
    rayon::scope(|_| work())
}
