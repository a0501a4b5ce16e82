//! Memory-mapped safetensors files (one or several shards) and dtype-converting reads.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var, WithDType};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

use crate::error::{Error, Result};

/// Where one tensor lives and what it is.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorMeta {
    pub file: usize,
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    /// Byte range inside the file (header included in the offset).
    pub start: usize,
    pub end: usize,
}

/// A set of memory-mapped safetensors files with one name index over all of them.
///
/// Mapping costs no heap: pages are read from the file (or page cache) as each tensor is decoded,
/// and the OS can drop them again, so the only resident copy is the decoded tensor.
pub struct SafetensorsFiles {
    paths: Vec<PathBuf>,
    maps: Vec<memmap2::Mmap>,
    index: HashMap<String, TensorMeta>,
}

/// The shard file names listed by a `*.safetensors.index.json` (its `weight_map` values).
pub fn shards_of_index(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Json {
            path: path.to_path_buf(),
            reason: "no `weight_map` object".into(),
        })?;
    let mut shards: Vec<String> = Vec::new();
    for (name, v) in map {
        let f = v.as_str().ok_or_else(|| Error::Json {
            path: path.to_path_buf(),
            reason: format!("weight_map entry `{name}` is not a file name"),
        })?;
        if !shards.iter().any(|s| s == f) {
            shards.push(f.to_string());
        }
    }
    shards.sort();
    Ok(shards)
}

fn dtype_size(d: StDtype) -> Option<usize> {
    match d {
        StDtype::F64 | StDtype::I64 | StDtype::U64 => Some(8),
        StDtype::F32 | StDtype::I32 | StDtype::U32 => Some(4),
        StDtype::F16 | StDtype::BF16 | StDtype::I16 | StDtype::U16 => Some(2),
        StDtype::U8 | StDtype::I8 | StDtype::BOOL => Some(1),
        _ => None,
    }
}

impl SafetensorsFiles {
    /// Maps `paths` and indexes their headers. A corrupt header names the file.
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let mut maps = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: the map is read-only; a checkpoint modified by another process while it is
            // being read is outside what any loader can defend against.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
            let (n, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| Error::CorruptSafetensors {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                index.insert(
                    name,
                    TensorMeta {
                        file: i,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: base + s,
                        end: base + e,
                    },
                );
            }
            maps.push(map);
        }
        Ok(SafetensorsFiles {
            paths: paths.to_vec(),
            maps,
            index,
        })
    }

    /// The files, in shard order.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Metadata of `name`, if present.
    pub fn meta(&self, name: &str) -> Option<&TensorMeta> {
        self.index.get(name)
    }

    /// Every tensor name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(|s| s.as_str())
    }

    /// The largest absolute difference between a tensor of these files and its namesake in
    /// `other` (compared in f64), and that tensor's name: how two runs that should have trained
    /// the same weights (a data-parallel run and one process, a resumed run and an uninterrupted
    /// one) are compared, over the tensors whose names `keep` keeps. Tensors missing on either
    /// side or of other shapes are an error.
    pub fn max_difference(
        &self,
        other: &SafetensorsFiles,
        keep: impl Fn(&str) -> bool,
    ) -> Result<(f64, String)> {
        let mut names: Vec<&str> = self.names().filter(|n| keep(n)).collect();
        names.sort_unstable();
        if let Some(extra) = other.names().find(|n| self.meta(n).is_none()) {
            return Err(Error::MissingTensor {
                name: format!("{extra} (in {})", other.files_label()),
                files: self.files_label(),
            });
        }
        let mut worst = (0f64, String::new());
        for name in names {
            let shape = self.meta(name).map(|m| m.shape.clone());
            let read = |f: &SafetensorsFiles| -> Result<Vec<f64>> {
                let t = f.load(name, shape.as_deref(), DType::F64, &Device::Cpu, false)?;
                Ok(t.flatten_all()?.to_vec1::<f64>()?)
            };
            let (a, b) = (read(self)?, read(other)?);
            for (x, y) in a.iter().zip(&b) {
                let d = (x - y).abs();
                // NaN on one side counts as the largest difference.
                if d > worst.0 || (d.is_nan() && !worst.0.is_nan()) {
                    worst = (d, name.to_string());
                }
            }
        }
        Ok(worst)
    }

    fn files_label(&self) -> String {
        let v: Vec<String> = self.paths.iter().map(|p| p.display().to_string()).collect();
        v.join(", ")
    }

    fn lookup(&self, name: &str, expected: Option<&[usize]>) -> Result<(&TensorMeta, &[u8])> {
        let meta = self.index.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            files: self.files_label(),
        })?;
        let path = &self.paths[meta.file];
        if let Some(exp) = expected {
            if exp != meta.shape.as_slice() {
                return Err(Error::WrongShape {
                    path: path.clone(),
                    name: name.to_string(),
                    expected: exp.to_vec(),
                    actual: meta.shape.clone(),
                });
            }
        }
        let bytes = self.maps[meta.file]
            .get(meta.start..meta.end)
            .ok_or_else(|| Error::CorruptSafetensors {
                path: path.clone(),
                reason: format!("tensor `{name}` lies outside the file"),
            })?;
        let n: usize = meta.shape.iter().product();
        let size = dtype_size(meta.dtype).ok_or_else(|| Error::UnsupportedDtype {
            path: path.clone(),
            name: name.to_string(),
            dtype: format!("{:?}", meta.dtype),
        })?;
        if bytes.len() != n * size {
            return Err(Error::CorruptSafetensors {
                path: path.clone(),
                reason: format!(
                    "tensor `{name}` has {} bytes for shape {:?}",
                    bytes.len(),
                    meta.shape
                ),
            });
        }
        Ok((meta, bytes))
    }

    /// Decodes `name` into a host buffer of `T`: the one copy a load makes.
    fn decode<T: WithDType>(&self, name: &str, meta: &TensorMeta, bytes: &[u8]) -> Result<Vec<T>> {
        fn conv<T: WithDType, const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> f64) -> Vec<T> {
            bytes
                .chunks_exact(N)
                .map(|c| {
                    let mut a = [0u8; N];
                    a.copy_from_slice(c);
                    T::from_f64(f(a))
                })
                .collect()
        }
        Ok(match meta.dtype {
            StDtype::F32 => conv::<T, 4>(bytes, |a| f32::from_le_bytes(a) as f64),
            StDtype::F64 => conv::<T, 8>(bytes, f64::from_le_bytes),
            StDtype::F16 => conv::<T, 2>(bytes, |a| half::f16::from_le_bytes(a).to_f64()),
            StDtype::BF16 => conv::<T, 2>(bytes, |a| half::bf16::from_le_bytes(a).to_f64()),
            other => {
                return Err(Error::UnsupportedDtype {
                    path: self.paths[meta.file].clone(),
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        })
    }

    /// Bit-exact same-dtype copy: bf16/f16 stay bit for bit (no round trip through f64 needed,
    /// but it is exact anyway); kept separate so the common case is a plain byte copy.
    fn raw<T: WithDType, const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect()
    }

    pub(crate) fn host_vec_tensor<T: WithDType>(
        data: Vec<T>,
        shape: &[usize],
        device: &Device,
        trainable: bool,
    ) -> Result<Tensor> {
        Ok(if trainable {
            Var::from_vec(data, shape, device)?.into_inner()
        } else {
            Tensor::from_vec(data, shape, device)?
        })
    }

    /// Reads `name` as `dtype` on `device`, checking its shape against `expected` when given.
    ///
    /// With `trainable` the result is a `Var`'s tensor (tracked by backprop). On CPU the decoded
    /// buffer becomes the tensor's storage; on a GPU it is copied once to the device and dropped.
    pub fn load(
        &self,
        name: &str,
        expected: Option<&[usize]>,
        dtype: DType,
        device: &Device,
        trainable: bool,
    ) -> Result<Tensor> {
        let (meta, bytes) = self.lookup(name, expected)?;
        let shape = meta.shape.clone();
        let t = match (meta.dtype, dtype) {
            (StDtype::BF16, DType::BF16) => Self::host_vec_tensor(
                Self::raw::<half::bf16, 2>(bytes, half::bf16::from_le_bytes),
                &shape,
                device,
                trainable,
            )?,
            (StDtype::F16, DType::F16) => Self::host_vec_tensor(
                Self::raw::<half::f16, 2>(bytes, half::f16::from_le_bytes),
                &shape,
                device,
                trainable,
            )?,
            (StDtype::U8, DType::U8) => {
                Self::host_vec_tensor(bytes.to_vec(), &shape, device, trainable)?
            }
            (StDtype::F32, DType::F32) => Self::host_vec_tensor(
                Self::raw::<f32, 4>(bytes, f32::from_le_bytes),
                &shape,
                device,
                trainable,
            )?,
            (_, DType::F32) => Self::host_vec_tensor(
                self.decode::<f32>(name, meta, bytes)?,
                &shape,
                device,
                trainable,
            )?,
            (_, DType::F64) => Self::host_vec_tensor(
                self.decode::<f64>(name, meta, bytes)?,
                &shape,
                device,
                trainable,
            )?,
            (_, DType::BF16) => Self::host_vec_tensor(
                self.decode::<half::bf16>(name, meta, bytes)?,
                &shape,
                device,
                trainable,
            )?,
            (_, DType::F16) => Self::host_vec_tensor(
                self.decode::<half::f16>(name, meta, bytes)?,
                &shape,
                device,
                trainable,
            )?,
            (_, other) => {
                return Err(Error::Invalid(format!(
                    "tensor `{name}`: cannot load weights as {other:?}"
                )))
            }
        };
        Ok(t)
    }
}
