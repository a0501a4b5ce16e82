//! The CUDA kernels' logic on any machine: `tests/emulated/harness.cc` compiles
//! `src/cuda/kernels.cu` as C++ under a host emulation of the CUDA features it uses (block
//! barriers, warp shuffles, shared memory, atomics: `tests/emulated/emu.h`) and checks every
//! kernel against a double-precision reference: softmax, norms, upsample, pooling, attention
//! forward and backward with and without bias or masks, AdamW, unscale, stochastic rounding.
//! Skips, saying so, where no C++ compiler (`$CXX`, default `g++`) runs. Real-GPU numerics are
//! checked by `tests/cuda.rs`.

use std::path::Path;
use std::process::Command;

#[test]
fn cuda_kernels_match_their_references_under_host_emulation() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emulated");
    let exe = std::env::temp_dir().join(format!("ft-kernels-emulated-{}", std::process::id()));
    let compiled = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O1",
            "-pthread",
            "-Wno-unknown-pragmas",
            "-o",
        ])
        .arg(&exe)
        .arg(dir.join("harness.cc"))
        .output();
    let compiled = match compiled {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: no C++ compiler `{cxx}` ({e})");
            return;
        }
    };
    assert!(
        compiled.status.success(),
        "{cxx} could not build the emulation harness:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    let run = Command::new(&exe)
        .output()
        .expect("run the emulation harness");
    let _ = std::fs::remove_file(&exe);
    let report = String::from_utf8_lossy(&run.stdout);
    eprintln!("{report}");
    assert!(run.status.success(), "kernel checks failed:\n{report}");
}
