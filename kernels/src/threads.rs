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

/// Puts candle's answer for the matrix products' threads in `RAYON_NUM_THREADS`, after making
/// rayon's global pool at the size it takes without the variable (the logical CPUs this process
/// may use), so both keep the sizes they had. Nothing when the variable is set already. Call it
/// first thing in `main`: changing the environment is sound only while no other thread reads
/// it.
pub fn settle() {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    let products = candle_core::utils::get_num_threads();
    // An error means the pool exists already (made at the size it had without the variable).
    let _ = rayon::ThreadPoolBuilder::new().build_global();
    std::env::set_var("RAYON_NUM_THREADS", products.to_string());
}
