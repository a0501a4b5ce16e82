//! The latent and embedding cache: every image encoded by the VAE once and every caption by both
//! text encoders once, written to disk, after which the VAE encoder and the text encoders are
//! dropped. Training then holds only the UNet, its gradients and optimizer state (seed 001).
//!
//! The cache is a folder named by a hash of everything that decides its contents (image files
//! with their sizes and modification times, captions, sample prompts, resolution, crop and flip
//! settings, the encoder weights by content); an unchanged run finds it and skips the encoders. It is
//! built in `<name>.tmp` and renamed when complete, so an interrupted build is never reused.
//!
//! Latents are stored as the posterior's mean and standard deviation (f32), so each training
//! step draws a fresh latent sample as diffusers does, rather than freezing one draw.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use candle_core::{DType, Device, Tensor};
use ft_models::vae::VaeParts;
use ft_params::rng::{hash_bytes, hash_str, SplitMix64};
use ft_params::weights::SafetensorsFiles;
use ft_trainer::ledger::{Category, Ledger};
use serde::{Deserialize, Serialize};

use crate::data::{prepare, Crop, ImageFolder};
use crate::pipeline::Pipeline;

const VERSION: &str = "sdxl-ft-cache-2";
/// Images per latent shard file (bounds the host memory of a cache build at high resolution).
const SHARD: usize = 256;

/// What decides the cache's contents besides the data and the model.
#[derive(Debug, Clone)]
pub struct CacheSettings {
    pub res: usize,
    /// Aspect-ratio buckets (height, width) to fit each image into; `None`: the `res` square.
    pub buckets: Option<Vec<(usize, usize)>>,
    pub crop: Crop,
    pub flip: bool,
    pub seed: u64,
    pub strict_images: bool,
    /// Device and dtype the encoders run in while the cache is built.
    pub device: Device,
    pub dtype: DType,
}

/// One cached training image.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    pub file: String,
    /// Index into the cached captions.
    pub caption: usize,
    /// (height, width) of the file.
    pub original: [usize; 2],
    /// (height, width) it was cut to: the square or its bucket (SDXL's target size).
    pub size: [usize; 2],
    /// [channels, height, width] of its latent.
    pub latent: [usize; 3],
    /// (top, left) of the crop, and of the flipped crop when flips are cached.
    pub crop: [usize; 2],
    pub crop_flipped: Option<[usize; 2]>,
}

/// The cache's index, `manifest.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub version: String,
    pub entries: Vec<Entry>,
    /// Images that could not be read, with the reason.
    pub skipped: Vec<(String, String)>,
    pub captions: Vec<String>,
    /// Caption index of the empty prompt (caption dropout and guidance).
    pub empty: usize,
    /// Caption indices of the sample prompts.
    pub prompts: Vec<usize>,
    pub res: usize,
    /// [channels, height, width] of a `res`-square latent (the sample images' shape).
    pub latent_shape: [usize; 3],
    pub latent_shards: Vec<String>,
}

/// An opened cache.
pub struct Cache {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// True when this run built it (false: found and reused).
    pub built: bool,
    latents: SafetensorsFiles,
    texts: SafetensorsFiles,
}

/// An image's identity: its path inside the data folder, size and modification time.
fn image_stamp(dir: &Path, p: &Path) -> String {
    let rel = p.strip_prefix(dir).unwrap_or(p).display().to_string();
    match std::fs::metadata(p) {
        Ok(m) => {
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            format!("{rel}:{}:{mtime}", m.len())
        }
        Err(_) => format!("{rel}:missing"),
    }
}

/// A weights file's identity by content: its name, size and a hash of its first and last MiB
/// (the header with every tensor's name and shape, and values at both ends). The same weights
/// in another folder or downloaded again give the same stamp.
fn weights_stamp(p: &Path) -> Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    const SPAN: u64 = 1 << 20;
    let mut f = std::fs::File::open(p).with_context(|| p.display().to_string())?;
    let len = f.metadata().with_context(|| p.display().to_string())?.len();
    let mut buf = Vec::new();
    (&mut f)
        .take(SPAN)
        .read_to_end(&mut buf)
        .with_context(|| p.display().to_string())?;
    f.seek(SeekFrom::Start(len.saturating_sub(SPAN)))
        .with_context(|| p.display().to_string())?;
    f.take(SPAN)
        .read_to_end(&mut buf)
        .with_context(|| p.display().to_string())?;
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    Ok(format!("{name}:{len}:{:016x}", hash_bytes(&buf)))
}

/// The cache folder name: a hash of everything its contents depend on.
fn key(
    pipeline: &Pipeline,
    folder: &ImageFolder,
    prompts: &[String],
    s: &CacheSettings,
) -> Result<String> {
    let mut parts = vec![
        VERSION.to_string(),
        // The buckets list holds --aspect-buckets and --bucket-step; the encoders' dtype decides
        // the cached values' precision.
        format!(
            "res={} crop={:?} flip={} seed={} buckets={:?} dtype={:?}",
            s.res, s.crop, s.flip, s.seed, s.buckets, s.dtype
        ),
    ];
    for (f, stem) in [
        ("vae", "diffusion_pytorch_model"),
        ("text_encoder", "model"),
        ("text_encoder_2", "model"),
    ] {
        for p in pipeline.weights(f, stem)?.paths() {
            parts.push(weights_stamp(p)?);
        }
    }
    for r in &folder.records {
        parts.push(image_stamp(&folder.dir, &r.path));
        parts.push(r.caption.clone());
    }
    parts.extend(prompts.iter().cloned());
    let h1 = hash_str(&parts.join("\u{1f}"));
    let h2 = hash_str(&parts.join("\u{1e}"));
    Ok(format!("{h1:016x}{:08x}", h2 >> 32))
}

impl Cache {
    /// Opens the cache for this data and model under `root`, building it first when absent.
    pub fn build_or_reuse(
        root: &Path,
        pipeline: &Pipeline,
        folder: &ImageFolder,
        prompts: &[String],
        s: &CacheSettings,
        ledger: &mut Ledger,
    ) -> Result<Self> {
        let dir = root.join(key(pipeline, folder, prompts, s)?);
        // Two runs sharing a cache folder build it one at a time: the second then reuses it.
        let _lock =
            ft_trainer::train::FolderLock::wait(root, ".ft-cache.lock", "building the cache")?;
        let built = !dir.join("manifest.json").is_file();
        if built {
            let tmp = dir.with_extension("tmp");
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).with_context(|| tmp.display().to_string())?;
            }
            std::fs::create_dir_all(&tmp).with_context(|| tmp.display().to_string())?;
            Self::build(&tmp, pipeline, folder, prompts, s, ledger)?;
            std::fs::rename(&tmp, &dir).with_context(|| dir.display().to_string())?;
        }
        Self::open(&dir, built)
    }

    /// Opens a complete cache folder.
    pub fn open(dir: &Path, built: bool) -> Result<Self> {
        let path = dir.join("manifest.json");
        let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| anyhow!("{}: not a cache manifest: {e}", path.display()))?;
        if manifest.version != VERSION {
            return Err(anyhow!(
                "{}: cache version {} (this build reads {VERSION})",
                path.display(),
                manifest.version
            ));
        }
        let shards: Vec<PathBuf> = manifest.latent_shards.iter().map(|s| dir.join(s)).collect();
        Ok(Cache {
            latents: SafetensorsFiles::open(&shards)?,
            texts: SafetensorsFiles::open(&[dir.join("texts.safetensors")])?,
            dir: dir.to_path_buf(),
            manifest,
            built,
        })
    }

    fn build(
        dir: &Path,
        pipeline: &Pipeline,
        folder: &ImageFolder,
        prompts: &[String],
        s: &CacheSettings,
        ledger: &mut Ledger,
    ) -> Result<()> {
        // Captions: the empty prompt first, then the data's and the sample prompts, deduplicated.
        let mut captions: Vec<String> = vec![String::new()];
        let mut index = std::collections::HashMap::new();
        index.insert(String::new(), 0usize);
        let mut caption_of = |t: &str, captions: &mut Vec<String>| {
            *index.entry(t.to_string()).or_insert_with(|| {
                captions.push(t.to_string());
                captions.len() - 1
            })
        };
        let record_captions: Vec<usize> = folder
            .records
            .iter()
            .map(|r| caption_of(&r.caption, &mut captions))
            .collect();
        let prompt_ids: Vec<usize> = prompts
            .iter()
            .map(|p| caption_of(p, &mut captions))
            .collect();
        Self::encode_texts(dir, pipeline, &captions, s, ledger)?;
        ledger.mark("cache/text", 0)?;

        let vae = pipeline.vae(VaeParts::Encoder, s.dtype, &s.device)?;
        ledger.set(
            Category::Other,
            "vae encoder",
            vae_bytes(pipeline, s.dtype)?,
        );
        let mut rng = SplitMix64::new(s.seed ^ 0xC0FF_EE00);
        let mut entries = Vec::new();
        let mut skipped = Vec::new();
        let mut shard: Vec<(String, Tensor)> = Vec::new();
        let mut shards = Vec::new();
        let f = pipeline.vae_factor();
        let latent_shape = [pipeline.vae.latent_channels, s.res / f, s.res / f];
        let flush = |shard: &mut Vec<(String, Tensor)>, shards: &mut Vec<String>| -> Result<()> {
            if shard.is_empty() {
                return Ok(());
            }
            let name = format!("latents-{:05}.safetensors", shards.len());
            ft_params::fs::save_safetensors(shard, &dir.join(&name))?;
            shard.clear();
            shards.push(name);
            Ok(())
        };
        for (r, &caption) in folder.records.iter().zip(&record_captions) {
            let target = match &s.buckets {
                None => Ok((s.res, s.res)),
                Some(b) => crate::data::image_size(&r.path)
                    .map(|size| crate::data::nearest_bucket(size, b)),
            };
            let plain = match target.and_then(|t| prepare(&r.path, t, s.crop, false, &mut rng)) {
                Ok(p) => p,
                Err(e) if !s.strict_images => {
                    skipped.push((r.path.display().to_string(), format!("{e:#}")));
                    continue;
                }
                Err(e) => return Err(e.context("--strict-images: stopping at an unreadable image")),
            };
            let i = entries.len();
            let size = [plain.pixels.dim(1)?, plain.pixels.dim(2)?];
            let mut latent = [0usize; 3];
            let mut views = vec![(plain.pixels, String::new())];
            let mut crop_flipped = None;
            if s.flip {
                // The flip of the same crop: mirror the pixels, move the corner as diffusers does.
                let flipped = views[0].0.flip(&[2])?;
                crop_flipped = Some([plain.crop.0, size[1] - plain.crop.1]);
                views.push((flipped, ".flip".into()));
            }
            for (pixels, suffix) in views {
                let x = pixels
                    .unsqueeze(0)?
                    .to_device(&s.device)?
                    .to_dtype(s.dtype)?;
                let (mean, logvar) = vae.encode_moments(&x)?;
                let std = (logvar * 0.5)?.exp()?;
                let host = |t: Tensor| -> Result<Tensor> {
                    Ok(t.squeeze(0)?
                        .to_dtype(DType::F32)?
                        .to_device(&Device::Cpu)?)
                };
                let mean = host(mean)?;
                let d = mean.dims3()?;
                latent = [d.0, d.1, d.2];
                shard.push((format!("mean.{i}{suffix}"), mean));
                shard.push((format!("std.{i}{suffix}"), host(std)?));
            }
            entries.push(Entry {
                file: r.path.display().to_string(),
                caption,
                original: [plain.original.0, plain.original.1],
                size,
                latent,
                crop: [plain.crop.0, plain.crop.1],
                crop_flipped,
            });
            if entries.len().is_multiple_of(SHARD) {
                flush(&mut shard, &mut shards)?;
            }
        }
        flush(&mut shard, &mut shards)?;
        drop(vae);
        ledger.remove(Category::Other, "vae encoder");
        ledger.mark("cache/latents", 0)?;
        if entries.is_empty() {
            return Err(anyhow!(
                "{}: none of the {} images could be read (first: {})",
                folder.dir.display(),
                skipped.len(),
                skipped
                    .first()
                    .map(|s| format!("{}: {}", s.0, s.1))
                    .unwrap_or_default()
            ));
        }
        let manifest = Manifest {
            version: VERSION.into(),
            entries,
            skipped,
            captions,
            empty: 0,
            prompts: prompt_ids,
            res: s.res,
            latent_shape,
            latent_shards: shards,
        };
        let text = serde_json::to_string_pretty(&manifest)?;
        ft_params::fs::write_atomic(&dir.join("manifest.json"), |f| {
            std::io::Write::write_all(f, text.as_bytes())
        })?;
        Ok(())
    }

    /// Both encoders' penultimate hidden states, concatenated ([L, 768 + 1280] for SDXL), and the
    /// second encoder's projected pooled output, for every caption.
    fn encode_texts(
        dir: &Path,
        pipeline: &Pipeline,
        captions: &[String],
        s: &CacheSettings,
        ledger: &mut Ledger,
    ) -> Result<()> {
        let mut hidden: Vec<Vec<Tensor>> = vec![Vec::new(); captions.len()];
        let mut pooled = Vec::new();
        for which in [1u8, 2] {
            let tok = pipeline.tokenizer(which)?;
            let enc = pipeline.text_encoder(which, s.dtype, &s.device)?;
            ledger.mark(&format!("cache/text_encoder_{which}"), 0)?;
            for (chunk_start, chunk) in captions.chunks(16).enumerate().map(|(i, c)| (i * 16, c)) {
                let ids = chunk
                    .iter()
                    .map(|c| tok.encode(c))
                    .collect::<Result<Vec<_>>>()?;
                let l = tok.max_length();
                let flat: Vec<u32> = ids.into_iter().flatten().collect();
                let ids = Tensor::from_vec(flat, (chunk.len(), l), &s.device)?;
                let out = enc.forward(&ids)?;
                let n = out.hidden_states.len();
                let h = out.hidden_states[n.saturating_sub(2)]
                    .to_dtype(DType::F32)?
                    .to_device(&Device::Cpu)?;
                for j in 0..chunk.len() {
                    hidden[chunk_start + j].push(h.get(j)?);
                    if which == 2 {
                        pooled.push(
                            out.pooled
                                .get(j)?
                                .to_dtype(DType::F32)?
                                .to_device(&Device::Cpu)?,
                        );
                    }
                }
            }
        }
        let mut tensors = Vec::with_capacity(2 * captions.len());
        for (i, (h, p)) in hidden.iter().zip(pooled).enumerate() {
            tensors.push((format!("hidden.{i}"), Tensor::cat(h, 1)?));
            tensors.push((format!("pooled.{i}"), p));
        }
        ft_params::fs::save_safetensors(&tensors, &dir.join("texts.safetensors"))?;
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.manifest.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.manifest.entries.is_empty()
    }

    /// Posterior mean and standard deviation of image `i` ([C, h, w], f32), flipped or not.
    pub fn latent(&self, i: usize, flipped: bool, device: &Device) -> Result<(Tensor, Tensor)> {
        let suffix = if flipped { ".flip" } else { "" };
        let load = |what: &str| {
            self.latents
                .load(
                    &format!("{what}.{i}{suffix}"),
                    None,
                    DType::F32,
                    device,
                    false,
                )
                .map_err(anyhow::Error::from)
        };
        Ok((load("mean")?, load("std")?))
    }

    /// Text states [L, D] and pooled embedding [P] of caption `c`, in `dtype` on `device`.
    pub fn text(&self, c: usize, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
        let load = |what: &str| {
            self.texts
                .load(&format!("{what}.{c}"), None, dtype, device, false)
                .map_err(anyhow::Error::from)
        };
        Ok((load("hidden")?, load("pooled")?))
    }

    /// SDXL's six time ids of image `i`: original size, crop corner, target size.
    pub fn time_ids(&self, i: usize, flipped: bool) -> [f32; 6] {
        let e = &self.manifest.entries[i];
        let crop = if flipped {
            e.crop_flipped.unwrap_or(e.crop)
        } else {
            e.crop
        };
        [
            e.original[0] as f32,
            e.original[1] as f32,
            crop[0] as f32,
            crop[1] as f32,
            e.size[0] as f32,
            e.size[1] as f32,
        ]
    }

    /// Bytes of the cache files on disk.
    pub fn disk_bytes(&self) -> u64 {
        std::fs::read_dir(&self.dir)
            .map(|d| {
                d.filter_map(|e| e.ok()?.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    }
}

/// Bytes of the VAE encoder's weights, for the ledger while the cache is built.
fn vae_bytes(pipeline: &Pipeline, dtype: DType) -> Result<u64> {
    let files = pipeline.weights("vae", "diffusion_pytorch_model")?;
    Ok(files
        .names()
        .filter(|n| n.starts_with("encoder.") || n.starts_with("quant_conv."))
        .filter_map(|n| {
            files
                .meta(n)
                .map(|m| (m.shape.iter().product::<usize>() * dtype.size_in_bytes()) as u64)
        })
        .sum())
}
