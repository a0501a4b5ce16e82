//! The CUDA kernels' logic on any machine: `tests/emulated/harness.cc` compiles the kernel files
//! of `src/cuda` as C++ under a host emulation of the CUDA features they use (block
//! barriers, warp shuffles, shared memory, atomics: `tests/emulated/emu.h`) and checks every
//! kernel against a double-precision reference, one file per family (`tests/emulated/*.cc`):
//! softmax, norms, upsample, pooling, attention forward and backward with and without bias or
//! masks, AdamW and 8-bit AdamW (with its code search on exact ties), Adafactor (factored and
//! full, in place), unscale, stochastic rounding, dropout, the gated feed-forward, the norm with
//! its weight, bias and activation (forward and both backward kernels). Skips, saying
//! so, where no C++ compiler (`$CXX`, default `g++`) runs. Real-GPU numerics are checked by
//! `tests/cuda/`.

use std::path::Path;
use std::process::Command;

/// Builds the harness with `defines` and runs it with `args`; `None` when no compiler runs.
fn run_harness(tag: &str, defines: &[&str], args: &[&str]) -> Option<()> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emulated");
    let exe =
        std::env::temp_dir().join(format!("ft-kernels-emulated-{tag}-{}", std::process::id()));
    let compiled = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas"])
        .args(defines)
        .arg("-o")
        .arg(&exe)
        .arg(dir.join("harness.cc"))
        .output();
    let compiled = match compiled {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: no C++ compiler `{cxx}` ({e})");
            return None;
        }
    };
    assert!(
        compiled.status.success(),
        "{cxx} could not build the emulation harness ({defines:?}):\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let run = Command::new(&exe)
        .args(args)
        .output()
        .expect("run the emulation harness");
    let _ = std::fs::remove_file(&exe);
    let report = String::from_utf8_lossy(&run.stdout);
    eprintln!("{report}");
    assert!(run.status.success(), "kernel checks failed:\n{report}");
    Some(())
}

#[test]
fn cuda_kernels_match_their_references_under_host_emulation() {
    run_harness("all", &[], &[]);
}

/// Below sm_60 there is no double-precision `atomicAdd`; grad_norm.cu then adds through a
/// compare-and-swap loop (an NVRTC 12 library and a Maxwell/Pascal-P100-less GPU take it).
/// NVRTC 13 has no target that old, so this build is where the loop is tested: 256 threads add
/// to one double at once, the emulated CAS makes them race, and the sum must be exact.
#[test]
fn double_atomic_fallback_below_sm60_survives_contention() {
    run_harness("sm52", &["-D__CUDA_ARCH__=520"], &["atomics"]);
}
