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

    /// Path of `file` in the model, downloading it from the hub when needed and allowed.
    pub fn get(&self, file: &str) -> Result<PathBuf> {
        match self {
            ModelRepo::Local(dir) => {
                let p = dir.join(file);
                if p.is_file() {
                    Ok(p)
                } else {
                    Err(Error::io(
                        p,
                        std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
                    ))
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
                    return Ok(p);
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
                api.repo(repo).get(file).map_err(|e| Error::Hub {
                    id: id.clone(),
                    reason: format!("`{file}`: {e}"),
                })
            }
        }
    }

    /// True when `file` exists locally or can be fetched (a missing optional file is not an error).
    pub fn has(&self, file: &str) -> bool {
        self.get(file).is_ok()
    }

    /// Opens the safetensors weights named `stem` (`model`, `diffusion_pytorch_model`, ...): the
    /// single file `{stem}.safetensors`, or the shards listed in `{stem}.safetensors.index.json`.
    /// `stem` may name a subfolder (`unet/diffusion_pytorch_model`).
    pub fn safetensors(&self, stem: &str) -> Result<SafetensorsFiles> {
        let single = format!("{stem}.safetensors");
        let index = format!("{stem}.safetensors.index.json");
        match self.get(&single) {
            Ok(p) => Ok(SafetensorsFiles::open(&[p])?),
            Err(single_err) => match self.get(&index) {
                Ok(idx) => {
                    let shards = shards_of_index(&idx)?;
                    // Shard names in an index are relative to its folder (`unet/` in diffusers).
                    let folder = stem.rsplit_once('/').map(|(d, _)| format!("{d}/"));
                    let paths = shards
                        .iter()
                        .map(|s| self.get(&format!("{}{s}", folder.as_deref().unwrap_or(""))))
                        .collect::<Result<Vec<_>>>()?;
                    Ok(SafetensorsFiles::open(&paths)?)
                }
                Err(_) => Err(single_err),
            },
        }
    }
}
