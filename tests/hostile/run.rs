//! Running a built binary as a user would, for the hostile-input suites of the three trainers
//! (`bins/*/tests/hostile.rs` include this file): its exit status and what it printed.
//!
//! A failure must be one clear error and a non-zero exit: status 1 from `main`'s `Err`, never a
//! panic (101) or a signal, and stderr holding the names the case asks for.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// What one run of a binary did.
pub struct Ran {
    pub args: Vec<String>,
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `bin` with `args`, stdout and stderr piped (as under a log collector), the Hugging Face
/// Hub offline so no case reaches the network, and no progress bars' terminal.
pub fn run(bin: &str, args: &[&str]) -> Ran {
    let out = Command::new(bin)
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_TOKEN")
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{bin} did not start: {e}"));
    Ran {
        args: args.iter().map(|s| s.to_string()).collect(),
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

impl Ran {
    /// Asserts a clean failure: status 1, one `Error:` on stderr, no panic, every `needle` in
    /// the message.
    pub fn fails_naming(&self, needles: &[&str]) -> &Self {
        assert_eq!(
            self.code,
            Some(1),
            "{:?} should fail with status 1 (not a panic or a signal):\n{}",
            self.args,
            self.stderr
        );
        assert!(
            !self.stderr.contains("panicked"),
            "{:?} panicked:\n{}",
            self.args,
            self.stderr
        );
        assert_eq!(
            self.stderr.matches("Error:").count(),
            1,
            "{:?}: one error message:\n{}",
            self.args,
            self.stderr
        );
        for n in needles {
            assert!(
                self.stderr.contains(n),
                "{:?}: the error should name `{n}`:\n{}",
                self.args,
                self.stderr
            );
        }
        self
    }

    /// Asserts success (status 0).
    pub fn succeeds(&self) -> &Self {
        assert_eq!(
            self.code,
            Some(0),
            "{:?} should succeed:\n{}",
            self.args,
            self.stderr
        );
        self
    }

    /// Asserts that stderr holds `needle`.
    pub fn says(&self, needle: &str) -> &Self {
        assert!(
            self.stderr.contains(needle),
            "{:?}: stderr should say `{needle}`:\n{}",
            self.args,
            self.stderr
        );
        self
    }

    /// Asserts that stderr does not hold `needle`.
    pub fn never_says(&self, needle: &str) -> &Self {
        assert!(
            !self.stderr.contains(needle),
            "{:?}: stderr should not say `{needle}`:\n{}",
            self.args,
            self.stderr
        );
        self
    }
}

/// A fresh folder under the system's temporary one, named for the suite and the case.
pub fn fresh(suite: &str, case: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("{suite}-hostile-{case}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temporary folder");
    d
}

/// `path` as an argument.
pub fn arg(path: &Path) -> String {
    path.display().to_string()
}

/// Every `.safetensors` file under `dir`, recursively.
pub fn safetensors_under(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "safetensors") {
                found.push(p);
            }
        }
    }
    found.sort();
    found
}

/// The permission bits of `path` (Unix).
#[cfg(unix)]
pub fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .map(|m| m.permissions().mode() & 0o777)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
