//! Writes that never destroy what was saved before: write a temporary file beside the target,
//! flush it to disk, then rename over the target (atomic on POSIX file systems). A crash or an
//! interrupt leaves either the old file or the new one, never a torn one.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "file".into());
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Writes through `write` into a temporary file, then renames it to `path`.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let tmp = temp_path(path);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        write(&mut f)?;
        f.flush()?;
        f.sync_all()
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(path, e));
    }
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Saves named tensors as one safetensors file, atomically.
pub fn save_safetensors(tensors: &[(String, candle_core::Tensor)], path: &Path) -> Result<()> {
    let map: std::collections::HashMap<String, candle_core::Tensor> =
        tensors.iter().cloned().collect();
    let tmp = temp_path(path);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    if let Err(e) = candle_core::safetensors::save(&map, &tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.into());
    }
    // The safetensors writer goes through a private temporary file (mode 0600): give the file
    // the mode every other file the run writes has, the process's umask applied.
    if let Err(e) = like_created_files(&tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Sets `path`'s permissions to those a file created plainly beside it gets (`File::create`:
/// 0666 less the process's umask), learnt from a probe file that is removed again.
fn like_created_files(path: &Path) -> Result<()> {
    let probe = temp_path(&path.with_file_name("mode-probe"));
    let perms = std::fs::File::create(&probe)
        .and_then(|f| f.metadata())
        .map(|m| m.permissions());
    let _ = std::fs::remove_file(&probe);
    let perms = perms.map_err(|e| Error::io(&probe, e))?;
    std::fs::set_permissions(path, perms).map_err(|e| Error::io(path, e))
}
