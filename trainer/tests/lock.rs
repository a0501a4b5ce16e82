//! One run per output folder: a second run into a folder in use gets one error naming the first;
//! a run that crashed (killed) leaves no lock behind; a shared folder's lock waits instead.

use std::time::Duration;

use clap::Parser;
use ft_trainer::scratch::Scratch;
use ft_trainer::train::{CommonArgs, FolderLock, SessionBuilder};

fn tmp(tag: &str) -> Scratch {
    Scratch::new(&format!("ft-lock-{tag}"))
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
}

#[test]
fn a_second_run_into_a_folder_in_use_is_refused_by_name() -> anyhow::Result<()> {
    let out = tmp("second");
    let o = out.display().to_string();
    let common = Cli::parse_from(["t", "--output-dir", &o]).common;
    let first = SessionBuilder::new(&common)?;
    let e = SessionBuilder::new(&common)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains(&o)
            && e.contains("in use by another run")
            && e.contains(&format!("process {}", std::process::id())),
        "{e}"
    );
    drop(first);
    // Free again once dropped. A process another test spawns at that moment holds a copy of
    // this process's descriptors (the lock's too) from its fork until its exec closes them, so
    // the lock may take a moment to come free.
    let mut again = SessionBuilder::new(&common);
    for _ in 0..50 {
        if again.is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        again = SessionBuilder::new(&common);
    }
    again?;
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}

/// A holder killed with SIGKILL (a crash) leaves the lock free: the operating system releases
/// a dead process's locks, so there is no stale lock to clean.
#[test]
fn a_killed_run_leaves_no_stale_lock() -> anyhow::Result<()> {
    let out = tmp("killed");
    std::fs::create_dir_all(&out)?;
    let held = FolderLock::acquire(&out)?;
    let path = held.path().to_path_buf();
    drop(held);
    let script = format!(
        "import fcntl, sys, time\nf = open({:?}, 'r+')\nfcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n",
        path.display().to_string()
    );
    let mut child = match std::process::Command::new("python3")
        .args(["-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("skipped: no python3 to hold the lock ({e})");
            return Ok(());
        }
    };
    let mut line = String::new();
    if let Some(out) = child.stdout.as_mut() {
        use std::io::BufRead;
        std::io::BufReader::new(out).read_line(&mut line)?;
    }
    assert_eq!(line.trim(), "held");
    assert!(FolderLock::acquire(&out).is_err(), "held by the child");
    child.kill()?;
    child.wait()?;
    FolderLock::acquire(&out)?;
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}

/// A shared folder's lock waits for its holder instead of failing.
#[test]
fn a_shared_folder_lock_waits_for_its_holder() -> anyhow::Result<()> {
    let dir = tmp("shared");
    let first = FolderLock::wait(&dir, ".cache.lock", "testing")?;
    let d = dir.path_buf();
    let waiter =
        std::thread::spawn(move || FolderLock::wait(&d, ".cache.lock", "testing").map(|_| ()));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!waiter.is_finished(), "the second one must wait");
    drop(first);
    waiter
        .join()
        .map_err(|_| anyhow::anyhow!("waiter panicked"))??;
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
