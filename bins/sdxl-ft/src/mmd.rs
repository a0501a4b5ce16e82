//! The distribution metric of evaluation (seed 003's `eval_mmd_samples`): N samples generated
//! from held-out captions against the N held-out images, compared as KID and CMMD over image
//! features. The features are a CLIP vision tower's image embeddings (`--eval-clip-model`,
//! L2-normalised as the CMMD reference code does) or, without one, the latents pooled to a 4 x 4
//! grid per channel (metric names `*_latent`). Every generated chunk is decoded, embedded and
//! moved to the host before the next is generated, so an evaluation holds one chunk's images;
//! the real images' features are computed once, at the start.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Tensor};
use ft_models::clip::{ClipImageNorm, ClipVisionConfig, ClipVisionModel};
use ft_params::rng::SplitMix64;
use ft_params::weights::SafetensorsFiles;
use ft_params::{ParamBuilder, ParamStore};
use ft_trainer::ledger::Ledger;
use ft_trainer::score::{cmmd, kid, Features};
use ft_trainer::train::ModelRepo;

use crate::cache::Cache;
use crate::data::{prepare, Crop};
use crate::sample::Prompt;
use crate::task::SdxlTask;

/// Cells per side of the grid latents are average-pooled to.
const GRID: usize = 4;

/// A CLIP vision tower's files, loaded at each evaluation and dropped after it.
pub struct ClipSource {
    pub spec: String,
    cfg: ClipVisionConfig,
    norm: ClipImageNorm,
    files: Arc<SafetensorsFiles>,
}

impl ClipSource {
    /// The tower of a folder or hub id: config.json (a CLIPVisionConfig or a whole CLIPConfig),
    /// model.safetensors and, when present, preprocessor_config.json.
    pub fn open(spec: &str) -> Result<Self> {
        Self::read(spec).map_err(|e| anyhow!("--eval-clip-model: {e:#}"))
    }

    fn read(spec: &str) -> Result<Self> {
        let repo = ModelRepo::open(spec)?;
        let cfg = ClipVisionConfig::from_file(&repo.get("config.json")?)?;
        let norm = match repo.find_if_available("preprocessor_config.json")? {
            Some(p) => ClipImageNorm::from_file(&p)?,
            None => ClipImageNorm::default(),
        };
        let files = Arc::new(repo.safetensors("model")?);
        Ok(ClipSource {
            spec: spec.to_string(),
            cfg,
            norm,
            files,
        })
    }

    fn load(&self, dtype: DType, device: &Device) -> Result<ClipVisionModel> {
        let pb = ParamBuilder::new(ParamStore::new(), dtype, device, 0)
            .frozen()
            .with_source(self.files.clone());
        ClipVisionModel::new(&pb, &self.cfg)
            .map_err(|e| anyhow!("--eval-clip-model {}: {e}", self.spec))
    }
}

/// The held-out set and its features.
pub struct MmdEval {
    /// The held-out images' latents and caption embeddings (the first `n` entries).
    pub cache: Cache,
    pub n: usize,
    clip: Option<ClipSource>,
    /// The CLIP tower's dtype (the encoders').
    dtype: DType,
    real: Features,
}

impl MmdEval {
    /// The first `n` images of `cache` as the real set, their features computed now (with the
    /// CLIP tower in `dtype`, from the images' files cut where the cache cut them, unflipped).
    pub fn new(
        cache: Cache,
        n: usize,
        clip: Option<ClipSource>,
        scaling: f64,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let n = n.min(cache.len());
        if n < 2 {
            return Err(anyhow!(
                "--eval-mmd-samples: {} readable held-out images in {}; KID and CMMD need at least 2",
                n,
                cache.dir.display()
            ));
        }
        let entries = &cache.manifest.entries[..n];
        let mut values = Vec::new();
        match &clip {
            Some(c) => {
                let model = c.load(dtype, device)?;
                let mut rng = SplitMix64::new(0);
                for e in entries {
                    let path = PathBuf::from(&e.file);
                    let crop = Crop::At(e.crop[0], e.crop[1]);
                    let img = prepare(&path, (e.size[0], e.size[1]), crop, false, &mut rng)?;
                    let img = img.pixels.to_device(device)?.unsqueeze(0)?;
                    values.extend(embed(&model, &c.norm, &img)?);
                }
            }
            None => {
                for i in 0..n {
                    let (mean, _) = cache.latent(i, false, &Device::Cpu)?;
                    values.extend(pool(&(mean * scaling)?.unsqueeze(0)?)?);
                }
            }
        }
        let d = values.len() / n;
        Ok(MmdEval {
            real: Features::from_f32(&values, d)?,
            cache,
            n,
            clip,
            dtype,
        })
    }

    /// What the features are, as the metrics' names end.
    pub fn features(&self) -> &'static str {
        if self.clip.is_some() {
            "clip"
        } else {
            "latent"
        }
    }

    /// Generates one sample per held-out caption with `task`'s UNet (at each image's size and
    /// aspect bucket), in chunks of `vae_decode_chunk` latents of one shape, and compares their
    /// features with the real ones: `kid_{features}` and `cmmd_{features}`.
    pub fn evaluate(
        &self,
        task: &SdxlTask,
        ledger: &mut Ledger,
        step: u64,
    ) -> Result<Vec<(String, f64)>> {
        let sampler = task.sampler()?;
        let models = match &self.clip {
            Some(c) => Some((task.decoder()?, c.load(self.dtype, &task.device)?, &c.norm)),
            None => None,
        };
        let entries = &self.cache.manifest.entries[..self.n];
        let chunk = task.eval.vae_decode_chunk.max(1);
        let mut values = Vec::with_capacity(self.real.rows() * self.real.dim());
        let mut i = 0;
        while i < entries.len() {
            // Consecutive images of one latent shape, at most a decode chunk of them.
            let mut end = i + 1;
            while end < entries.len() && end - i < chunk && entries[end].latent == entries[i].latent
            {
                end += 1;
            }
            let mut latents = Vec::with_capacity(end - i);
            for (k, e) in entries.iter().enumerate().take(end).skip(i) {
                let p = Prompt {
                    caption: e.caption,
                    latent: e.latent,
                    size: (e.size[0], e.size[1]),
                    seed: task.seed ^ 0x3D3D_0000 ^ k as u64,
                };
                latents.push(task.denoise(&self.cache, &p, &sampler)?);
            }
            let latents = Tensor::cat(&latents, 0)?;
            match &models {
                Some((vae, clip, norm)) => {
                    let images = task.decode(vae, &latents)?.to_device(&task.device)?;
                    values.extend(embed(clip, norm, &images)?);
                }
                None => values.extend(pool(&latents)?),
            }
            i = end;
        }
        drop(models);
        ledger.mark("eval/mmd", step)?;
        let fake = Features::from_f32(&values, self.real.dim())?;
        let f = self.features();
        Ok(vec![
            (format!("kid_{f}"), kid(&self.real, &fake)?),
            (format!("cmmd_{f}"), cmmd(&self.real, &fake)?),
        ])
    }
}

/// Images [B, 3, H, W] in [-1, 1] as L2-normalised CLIP image embeddings, row after row, on
/// the host.
fn embed(model: &ClipVisionModel, norm: &ClipImageNorm, images: &Tensor) -> Result<Vec<f32>> {
    let e = model
        .forward(&model.preprocess(images, norm)?)?
        .image_embeds
        .to_dtype(DType::F32)?;
    let e = e.broadcast_div(&e.sqr()?.sum_keepdim(1)?.sqrt()?)?;
    Ok(e.flatten_all()?.to_device(&Device::Cpu)?.to_vec1::<f32>()?)
}

/// Latents [B, C, h, w] average-pooled to a GRID x GRID grid per channel (adaptive pooling's
/// cells, so any bucket's latent gives C * GRID^2 values), row after row, on the host.
fn pool(latents: &Tensor) -> Result<Vec<f32>> {
    let (b, c, h, w) = latents.dims4()?;
    let v = latents
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let cell = |i: usize, n: usize| (i * n / GRID, ((i + 1) * n).div_ceil(GRID));
    let mut out = Vec::with_capacity(b * c * GRID * GRID);
    for plane in v.chunks(h * w) {
        for gy in 0..GRID {
            let (y0, y1) = cell(gy, h);
            for gx in 0..GRID {
                let (x0, x1) = cell(gx, w);
                let mut s = 0f64;
                for y in y0..y1 {
                    s += plane[y * w + x0..y * w + x1]
                        .iter()
                        .map(|&x| x as f64)
                        .sum::<f64>();
                }
                out.push((s / ((y1 - y0) * (x1 - x0)) as f64) as f32);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_averages_adaptive_cells_per_channel() -> Result<()> {
        // One channel of 4 x 4 is itself; 8 x 8 averages 2 x 2 blocks; 6 x 6 cells overlap as
        // torch's adaptive_avg_pool2d's do (rows and columns 0..2, 1..3, 3..5, 4..6).
        let x = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((1, 1, 4, 4))?;
        assert_eq!(pool(&x)?, (0..16).map(|v| v as f32).collect::<Vec<_>>());
        let x = Tensor::arange(0f32, 64., &Device::Cpu)?.reshape((1, 1, 8, 8))?;
        assert_eq!(
            pool(&x)?[..2],
            [(0. + 1. + 8. + 9.) / 4., (2. + 3. + 10. + 11.) / 4.]
        );
        let x = Tensor::arange(0f32, 72., &Device::Cpu)?.reshape((2, 1, 6, 6))?;
        let p = pool(&x)?;
        assert_eq!(p.len(), 2 * 16);
        assert_eq!(p[0], (0. + 1. + 6. + 7.) / 4.);
        assert_eq!(p[1], (1. + 2. + 7. + 8.) / 4.);
        assert_eq!(p[5], (7. + 8. + 13. + 14.) / 4.);
        assert_eq!(p[16], 36. + (0. + 1. + 6. + 7.) / 4.);
        // 5 x 7 against torch.nn.functional.adaptive_avg_pool2d(arange(35).reshape(1, 1, 5, 7), 4).
        let x = Tensor::arange(0f32, 35., &Device::Cpu)?.reshape((1, 1, 5, 7))?;
        assert_eq!(
            pool(&x)?,
            [
                4.0, 5.5, 7.5, 9.0, 11.0, 12.5, 14.5, 16.0, 18.0, 19.5, 21.5, 23.0, 25.0, 26.5,
                28.5, 30.0
            ]
        );
        Ok(())
    }
}
