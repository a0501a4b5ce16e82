//! Where a model's files come from: a local folder or a Hugging Face Hub id (through the
//! hf-hub cache). Kept on the training side: the models read files, they never fetch them.

use std::path::{Path, PathBuf};

use ft_params::weights::{shards_of_index, SafetensorsFiles};

use crate::error::{Error, Result};

/// A model folder on disk or a hub repository (resolved through the hf-hub cache).
///
/// The hub path honours `HF_HOME` (cache location), `HF_ENDPOINT`, `HF_TOKEN` (or the token file
/// in the cache) and `HF_HUB_OFFLINE` (only the local cache is read, nothing is downloaded).
#[derive(Debug, Clone)]
pub enum ModelRepo {
    Local(PathBuf),
    Hub { id: String, revision: String },
}

fn env_flag(name: &str) -> bool {
    matches!(
        std::env::var(name).map(|v| v.to_ascii_lowercase()),
        Ok(v) if v == "1" || v == "true" || v == "yes" || v == "on"
    )
}

impl ModelRepo {
    /// A folder if `spec` names one, else a hub id of the form `owner/name` (optionally
    /// `owner/name@revision`).
    pub fn open(spec: &str) -> Result<Self> {
        let path = Path::new(spec);
        if path.is_dir() {
            return Ok(ModelRepo::Local(path.to_path_buf()));
        }
        let (id, revision) = match spec.split_once('@') {
            Some((id, rev)) => (id, rev.to_string()),
            None => (spec, "main".to_string()),
        };
        let parts: Vec<&str> = id.split('/').collect();
        let valid = |p: &str| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        };
        if parts.len() == 2 && parts.iter().all(|p| valid(p)) {
            Ok(ModelRepo::Hub {
                id: id.to_string(),
                revision,
            })
        } else {
            Err(Error::Hub {
                id: spec.to_string(),
                reason: "neither an existing folder nor a hub id of the form owner/name".into(),
            })
        }
    }

    /// Path of `file` in the model, downloading it from the hub when needed and allowed; a
    /// missing file is an error naming it.
    pub fn get(&self, file: &str) -> Result<PathBuf> {
        self.find(file)?.ok_or_else(|| self.missing(file))
    }

    /// Path of `file` in the model, or `None` when the model certainly has no such file (absent
    /// from the folder; a 404 from the hub). Anything that leaves it unknown is an error: a
    /// folder that cannot be read, a network failure, a file absent from the cache while
    /// `HF_HUB_OFFLINE` is set. Optional files are looked up with this, so that a failure is
    /// never taken for absence.
    pub fn find(&self, file: &str) -> Result<Option<PathBuf>> {
        match self {
            ModelRepo::Local(dir) => {
                let p = dir.join(file);
                match std::fs::metadata(&p) {
                    Ok(m) if m.is_file() => Ok(Some(p)),
                    Ok(_) => Err(Error::io(
                        &p,
                        std::io::Error::other("not a file (a folder?)"),
                    )),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(Error::io(&p, e)),
                }
            }
            ModelRepo::Hub { id, revision } => {
                let repo = hf_hub::Repo::with_revision(
                    id.clone(),
                    hf_hub::RepoType::Model,
                    revision.clone(),
                );
                let cache = hf_hub::Cache::from_env();
                if let Some(p) = cache.repo(repo.clone()).get(file) {
                    return Ok(Some(p));
                }
                if env_flag("HF_HUB_OFFLINE") {
                    return Err(Error::Hub {
                        id: id.clone(),
                        reason: format!(
                            "`{file}` is not in the cache at {} and HF_HUB_OFFLINE is set",
                            cache.path().display()
                        ),
                    });
                }
                let token = std::env::var("HF_TOKEN").ok().or_else(|| cache.token());
                let api = hf_hub::api::sync::ApiBuilder::from_env()
                    .with_token(token)
                    .build()
                    .map_err(|e| Error::Hub {
                        id: id.clone(),
                        reason: e.to_string(),
                    })?;
                match api.repo(repo).get(file) {
                    Ok(p) => Ok(Some(p)),
                    Err(hf_hub::api::sync::ApiError::RequestError(e))
                        if matches!(*e, ureq::Error::Status(404, _)) =>
                    {
                        Ok(None)
                    }
                    Err(e) => Err(Error::Hub {
                        id: id.clone(),
                        reason: format!("`{file}`: {e}"),
                    }),
                }
            }
        }
    }

    /// [`Self::find`] for a file whose absence only changes a default (a tokenizer's optional
    /// config, a weights variant that falls back to the default weights): also `None` when
    /// `HF_HUB_OFFLINE` is set and the cache lacks it. Never for weights a run cannot go without.
    pub fn find_if_available(&self, file: &str) -> Result<Option<PathBuf>> {
        match self.find(file) {
            Err(Error::Hub { .. }) if env_flag("HF_HUB_OFFLINE") => Ok(None),
            other => other,
        }
    }

    /// The error of a file the model does not have.
    fn missing(&self, file: &str) -> Error {
        match self {
            ModelRepo::Local(dir) => Error::io(
                dir.join(file),
                std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
            ),
            ModelRepo::Hub { id, .. } => Error::Hub {
                id: id.clone(),
                reason: format!("the repository has no `{file}`"),
            },
        }
    }

    /// Opens the safetensors weights named `stem` (`model`, `diffusion_pytorch_model`, ...): the
    /// single file `{stem}.safetensors`, or the shards listed in `{stem}.safetensors.index.json`.
    /// `stem` may name a subfolder (`unet/diffusion_pytorch_model`). Neither there is an error
    /// that names both and the weight files of other formats the folder holds.
    pub fn safetensors(&self, stem: &str) -> Result<SafetensorsFiles> {
        self.safetensors_if_present(stem)?
            .ok_or_else(|| self.missing_weights(stem))
    }

    /// The error for a model without `stem`'s safetensors, naming the weight files it has
    /// instead (a `pytorch_model.bin`, say).
    pub fn missing_weights(&self, stem: &str) -> Error {
        let others = self.other_weight_files(stem);
        let found = if others.is_empty() {
            String::new()
        } else {
            format!(
                " (it has {}: only safetensors are read; convert them, e.g. transformers' \
                 save_pretrained(dir, safe_serialization=True))",
                others.join(", ")
            )
        };
        match self {
            ModelRepo::Local(dir) => Error::Invalid(format!(
                "{}: no {stem}.safetensors nor {stem}.safetensors.index.json{found}",
                dir.display()
            )),
            ModelRepo::Hub { id, .. } => Error::Hub {
                id: id.clone(),
                reason: format!("no {stem}.safetensors nor {stem}.safetensors.index.json{found}"),
            },
        }
    }

    /// [`Self::safetensors`], or `None` when the model certainly has neither file (see
    /// [`Self::find`]: any other failure is an error).
    pub fn safetensors_if_present(&self, stem: &str) -> Result<Option<SafetensorsFiles>> {
        self.safetensors_lookup(stem, |f| self.find(f))
    }

    /// [`Self::safetensors_if_present`] for weights that fall back to others when absent (a
    /// `--variant`): also `None` offline when the cache lacks them ([`Self::find_if_available`]).
    pub fn safetensors_if_available(&self, stem: &str) -> Result<Option<SafetensorsFiles>> {
        self.safetensors_lookup(stem, |f| self.find_if_available(f))
    }

    fn safetensors_lookup(
        &self,
        stem: &str,
        find: impl Fn(&str) -> Result<Option<PathBuf>>,
    ) -> Result<Option<SafetensorsFiles>> {
        if let Some(p) = find(&format!("{stem}.safetensors"))? {
            return Ok(Some(SafetensorsFiles::open(&[p])?));
        }
        let Some(idx) = find(&format!("{stem}.safetensors.index.json"))? else {
            return Ok(None);
        };
        let shards = shards_of_index(&idx)?;
        // Shard names in an index are relative to its folder (`unet/` in diffusers).
        let folder = stem.rsplit_once('/').map(|(d, _)| format!("{d}/"));
        let paths = shards
            .iter()
            .map(|s| self.get(&format!("{}{s}", folder.as_deref().unwrap_or(""))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(SafetensorsFiles::open(&paths)?))
    }

    /// Weight files of other formats beside `stem` in a local folder (`pytorch_model.bin`,
    /// `*.ckpt`, ...), for the error that says why none was read; none known for a hub id.
    fn other_weight_files(&self, stem: &str) -> Vec<String> {
        let ModelRepo::Local(dir) = self else {
            return Vec::new();
        };
        let sub = stem.rsplit_once('/').map(|(d, _)| dir.join(d));
        let folder = sub.unwrap_or_else(|| dir.clone());
        let Ok(entries) = std::fs::read_dir(&folder) else {
            return Vec::new();
        };
        let mut found: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| {
                [".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"]
                    .iter()
                    .any(|ext| n.ends_with(ext))
            })
            .collect();
        found.sort();
        found
    }
}
