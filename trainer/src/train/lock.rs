//! One run per folder: an advisory lock (`flock`) on a file in the run's output folder, held for
//! as long as the run. A second run into the same folder gets one clear error naming the first
//! (its process id and start time); a crashed run leaves no stale lock, as the operating system
//! releases a dead process's locks. Shared folders that a run writes only for a while (sdxl-ft's
//! cache) are locked the same way, waiting instead of failing.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The lock file of a run's output folder.
const RUN_LOCK: &str = ".ft-run.lock";

/// A held lock on a folder; released when dropped (or when the process ends, however it ends).
#[derive(Debug)]
pub struct FolderLock {
    _file: File,
    path: PathBuf,
}

impl FolderLock {
    /// Takes the lock of `dir` (created if needed) for a run, or fails naming who holds it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let (mut file, path) = open(dir, RUN_LOCK)?;
        match file.try_lock() {
            Ok(()) => Self::held(file, path),
            Err(TryLockError::WouldBlock) => Err(Error::Invalid(format!(
                "{} is in use by another run ({}): wait for it to end, or pass another \
                 --output-dir",
                dir.display(),
                holder(&mut file)
            ))),
            Err(TryLockError::Error(e)) => Err(Error::io(&path, e)),
        }
    }

    /// Takes the lock file `name` of `dir` (a lock of its own, apart from a run's), waiting (and
    /// saying so) while another process holds it.
    pub fn wait(dir: &Path, name: &str, what: &str) -> Result<Self> {
        let (mut file, path) = open(dir, name)?;
        match file.try_lock() {
            Ok(()) => return Self::held(file, path),
            Err(TryLockError::WouldBlock) => eprintln!(
                "waiting for another run ({}) to finish {what} in {}",
                holder(&mut file),
                dir.display()
            ),
            Err(TryLockError::Error(e)) => return Err(Error::io(&path, e)),
        }
        file.lock().map_err(|e| Error::io(&path, e))?;
        Self::held(file, path)
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes who holds the lock into it, for the error a second run gets.
    fn held(mut file: File, path: PathBuf) -> Result<Self> {
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let who = format!(
            "process {}, started at unix time {started}",
            std::process::id()
        );
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| file.write_all(who.as_bytes()))
            .and_then(|_| file.flush())
            .map_err(|e| Error::io(&path, e))?;
        Ok(FolderLock { _file: file, path })
    }
}

/// The lock file `name` of `dir`, opened for reading and writing (created, never truncated
/// here: the holder's words stay until it takes the lock).
fn open(dir: &Path, name: &str) -> Result<(File, PathBuf)> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let path = dir.join(name);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::io(&path, e))?;
    Ok((file, path))
}

/// What the holder wrote into the lock file.
fn holder(file: &mut File) -> String {
    let mut who = String::new();
    let _ = file.rewind().and_then(|_| file.read_to_string(&mut who));
    if who.trim().is_empty() {
        "starting".into()
    } else {
        who.trim().to_string()
    }
}
