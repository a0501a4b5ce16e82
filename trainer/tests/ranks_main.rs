//! `ranks::main` (its own test binary: it settles the process's thread counts): a binary's
//! body runs on one of rayon's threads, where the CPU ops split without waking the caller
//! (docs/benchmarks.md, "The work on one of rayon's threads"), and its result comes back.

#[test]
fn a_binarys_body_runs_on_one_of_rayons_threads() {
    let main = std::thread::current().id();
    let on_pool = ft_trainer::train::ranks::main(|| {
        if rayon::current_thread_index().is_some() && std::thread::current().id() != main {
            Ok(())
        } else {
            Err("the body ran outside rayon's pool".to_string())
        }
    });
    assert_eq!(on_pool, Ok(()));
    let failed = ft_trainer::train::ranks::main(|| Err::<(), _>("body's error".to_string()));
    assert_eq!(failed, Err("body's error".to_string()));
}
