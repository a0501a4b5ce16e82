//! `threads::settle` (its own test binary: it changes the process's environment): candle's
//! answer for the matrix products' threads goes into `RAYON_NUM_THREADS`, and rayon's global
//! pool keeps the size it has without the variable.

#[test]
fn settle_writes_candles_count_and_keeps_rayons_pool() {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        // Set by whoever runs the tests: settle leaves it alone.
        let before = std::env::var("RAYON_NUM_THREADS").ok();
        ft_kernels::threads::settle();
        assert_eq!(std::env::var("RAYON_NUM_THREADS").ok(), before);
        return;
    }
    let products = candle_core::utils::get_num_threads();
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    ft_kernels::threads::settle();
    assert_eq!(
        std::env::var("RAYON_NUM_THREADS").ok(),
        Some(products.to_string())
    );
    assert_eq!(candle_core::utils::get_num_threads(), products);
    assert_eq!(rayon::current_num_threads(), logical);
}
