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

/// One tensor of a file [`save_safetensors_streamed`] writes: what the file's header says of it.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: candle_core::DType,
    pub shape: Vec<usize>,
}

impl TensorEntry {
    /// The entry describing `t` under `name`.
    pub fn of(name: &str, t: &candle_core::Tensor) -> Self {
        TensorEntry {
            name: name.to_string(),
            dtype: t.dtype(),
            shape: t.dims().to_vec(),
        }
    }
}

/// Saves the tensors `entries` describe as one safetensors file, atomically, asking `next` for
/// each in order and writing it before asking for the next. The header is written first from
/// the entries alone, so the writer never holds more than the one tensor in hand: rank 0 of a
/// data-parallel run writes what the other ranks send one tensor at a time without gathering
/// it all first. A tensor whose dtype or shape is not its entry's is an error naming it; an
/// error leaves whatever was at `path` as it was.
pub fn save_safetensors_streamed<E: From<Error>>(
    path: &Path,
    entries: &[TensorEntry],
    mut next: impl FnMut(usize) -> std::result::Result<candle_core::Tensor, E>,
) -> std::result::Result<(), E> {
    use safetensors::View;
    let header = safetensors_header(path, entries)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let tmp = temp_path(path);
    let result = (|| -> std::result::Result<(), E> {
        let file = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        let io = |e| Error::io(&tmp, e);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io)?;
        out.write_all(&header).map_err(io)?;
        for (i, entry) in entries.iter().enumerate() {
            let t = next(i)?;
            if t.dtype() != entry.dtype || t.dims() != entry.shape.as_slice() {
                return Err(Error::Invalid(format!(
                    "{}: tensor `{}` came as {:?} {:?}, its header says {:?} {:?}",
                    path.display(),
                    entry.name,
                    t.dtype(),
                    t.dims(),
                    entry.dtype,
                    entry.shape
                ))
                .into());
            }
            out.write_all(&t.data()).map_err(io)?;
        }
        let file = out.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    Ok(())
}

/// The JSON header of a safetensors file holding `entries` in that order, padded with spaces to
/// a multiple of 8 bytes (as the format's own writer pads it).
fn safetensors_header(path: &Path, entries: &[TensorEntry]) -> Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    let mut at = 0usize;
    for e in entries {
        let code = match e.dtype {
            candle_core::DType::U8 => "U8",
            candle_core::DType::U32 => "U32",
            candle_core::DType::I64 => "I64",
            candle_core::DType::BF16 => "BF16",
            candle_core::DType::F16 => "F16",
            candle_core::DType::F32 => "F32",
            candle_core::DType::F64 => "F64",
            other => {
                return Err(Error::Invalid(format!(
                    "{}: tensor `{}` is {other:?}, which this writer does not store",
                    path.display(),
                    e.name
                )))
            }
        };
        let len = e.shape.iter().product::<usize>() * e.dtype.size_in_bytes();
        let previous = map.insert(
            e.name.clone(),
            serde_json::json!({"dtype": code, "shape": e.shape, "data_offsets": [at, at + len]}),
        );
        if previous.is_some() {
            return Err(Error::Invalid(format!(
                "{}: tensor `{}` is listed twice",
                path.display(),
                e.name
            )));
        }
        at += len;
    }
    let mut header = serde_json::Value::Object(map).to_string().into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    Ok(header)
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
