//! sdxl-ft's [`Task`]: cached latents and text embeddings in, the DDPM loss of the UNet out;
//! evaluation writes sample images with the EMA weights swapped in; saves diffusers' layout.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Tensor, Var};
use ft_models::diffusion::NoiseSchedule;
use ft_models::sampling::SamplerKind;
use ft_models::unet::UNet;
use ft_params::checkpoint::Checkpointer;
use ft_params::rng::SplitMix64;
use ft_params::ParamStore;
use ft_trainer::ledger::{Category, Ledger};
use ft_trainer::train::ema::Ema;
use ft_trainer::train::{EpochOrder, Epochs, Grouping, StepCtx, Task, TaskResult};

use crate::cache::Cache;
use crate::mmd::MmdEval;
use crate::pipeline::Pipeline;

/// The objective's settings.
#[derive(Debug, Clone)]
pub struct Objective {
    pub caption_dropout: f64,
    pub snr_gamma: Option<f64>,
    pub noise_offset: f64,
    pub flip: bool,
}

/// What an evaluation does.
#[derive(Debug, Clone)]
pub struct EvalSettings {
    /// Images of the cache whose loss at fixed noise and timesteps is the validation loss.
    pub loss_images: usize,
    pub sampler: SamplerKind,
    pub steps: usize,
    pub guidance_scale: f64,
    pub vae_decode_chunk: usize,
    /// Spatial VAE tiles in latent pixels (0: whole images).
    pub vae_tile: usize,
    /// Samples are written under `dir/step-N/`.
    pub dir: PathBuf,
}

/// The UNet being trained with its data, objective and evaluation.
pub struct SdxlTask {
    pub unet: UNet,
    pub store: Arc<ParamStore>,
    pub pipeline: Pipeline,
    pub cache: Cache,
    pub schedule: NoiseSchedule,
    pub objective: Objective,
    pub eval: EvalSettings,
    pub ema: Option<Ema>,
    /// `--eval-mmd-samples`: the held-out set whose KID and CMMD each evaluation reports.
    pub mmd: Option<MmdEval>,
    pub device: Device,
    /// dtype of the UNet's weights and activations.
    pub dtype: DType,
    pub batch_size: usize,
    pub seed: u64,
    /// The cached images' order, epoch by epoch: micro-batches of one latent shape (one aspect
    /// bucket) each.
    order: EpochOrder,
    epochs: Epochs<Vec<usize>>,
}

/// A micro-batch: indices into the cache.
pub type Batch = Vec<usize>;

pub(crate) fn normal(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal() as f32).collect()
}

impl SdxlTask {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        unet: UNet,
        store: Arc<ParamStore>,
        pipeline: Pipeline,
        cache: Cache,
        schedule: NoiseSchedule,
        objective: Objective,
        eval: EvalSettings,
        ema: Option<Ema>,
        device: Device,
        dtype: DType,
        batch_size: usize,
        seed: u64,
    ) -> Self {
        let order = EpochOrder {
            items: cache.len(),
            batch_size,
            seed,
            shuffle: true,
            grouping: Grouping::Buckets(latent_shapes(&cache, cache.len())),
        };
        let mut epochs = Epochs::default();
        epochs.start(0, order.batches(0));
        SdxlTask {
            unet,
            store,
            pipeline,
            cache,
            schedule,
            objective,
            eval,
            ema,
            mmd: None,
            device,
            dtype,
            batch_size,
            seed,
            order,
            epochs,
        }
    }

    /// Micro-batches in one pass over the cached images (short last ones per bucket included).
    pub fn batches_per_epoch(&self) -> usize {
        self.order.batches_per_epoch()
    }

    /// The loss of every sample in `batch`, each the mean squared error over its latent
    /// (min-SNR weighted when asked), with noise, timesteps, latent samples, flips and caption
    /// dropout drawn per sample from `seed` and the sample's position in its micro-batch (the
    /// batch's first at `first`): a micro-batch split in two draws what the whole drew.
    fn per_sample_losses(
        &self,
        batch: &[usize],
        seed: u64,
        first: usize,
        train: bool,
        ck: &Checkpointer,
    ) -> Result<Tensor> {
        let b = batch.len();
        let entries = &self.cache.manifest.entries;
        let [c, h, w] = entries[batch[0]].latent;
        if batch.iter().any(|&i| entries[i].latent != [c, h, w]) {
            return Err(anyhow!(
                "a micro-batch mixes latent shapes (aspect buckets)"
            ));
        }
        let n = c * h * w;
        let (mut means, mut stds, mut hidden, mut pooled, mut ids) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut timesteps = Vec::with_capacity(b);
        let (mut posterior, mut noise, mut per_channel) = (
            Vec::with_capacity(b * n),
            Vec::with_capacity(b * n),
            Vec::with_capacity(b * c),
        );
        for (j, &i) in batch.iter().enumerate() {
            let mut rng = SplitMix64::new(
                seed ^ ((first + j) as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
            );
            let flipped = self.objective.flip && rng.uniform() < 0.5;
            let (m, s) = self.cache.latent(i, flipped, &self.device)?;
            means.push(m);
            stds.push(s);
            let caption = if train && rng.uniform() < self.objective.caption_dropout {
                self.cache.manifest.empty
            } else {
                self.cache.manifest.entries[i].caption
            };
            let (hs, p) = self.cache.text(caption, self.dtype, &self.device)?;
            hidden.push(hs);
            pooled.push(p);
            ids.extend_from_slice(&self.cache.time_ids(i, flipped));
            timesteps.push(rng.below(self.schedule.alphas_cumprod.len()));
            posterior.extend(normal(&mut rng, n));
            noise.extend(normal(&mut rng, n));
            if self.objective.noise_offset > 0.0 {
                per_channel.extend(normal(&mut rng, c));
            }
        }
        let dev = &self.device;
        let posterior = Tensor::from_vec(posterior, (b, c, h, w), dev)?;
        let scale = self.pipeline.vae.scaling_factor;
        let x0 = ((Tensor::stack(&means, 0)? + (Tensor::stack(&stds, 0)? * posterior)?)? * scale)?;
        let mut noise = Tensor::from_vec(noise, (b, c, h, w), dev)?;
        if self.objective.noise_offset > 0.0 {
            let per_channel = Tensor::from_vec(per_channel, (b, c, 1, 1), dev)?;
            noise = ft_models::diffusion::offset_noise(
                &noise,
                self.objective.noise_offset,
                &per_channel,
            )?;
        }
        let noisy = self.schedule.add_noise(&x0, &noise, &timesteps)?;
        let target = self.schedule.target(&x0, &noise, &timesteps)?;
        let t: Vec<f32> = timesteps.iter().map(|&t| t as f32).collect();
        let time_ids = Tensor::from_vec(ids, (b, 6), dev)?.to_dtype(self.dtype)?;
        let pred = self
            .unet
            .forward(
                &noisy.to_dtype(self.dtype)?,
                &t,
                &Tensor::stack(&hidden, 0)?,
                Some((&Tensor::stack(&pooled, 0)?, &time_ids)),
                ck,
            )?
            .to_dtype(DType::F32)?;
        let mse = (pred - target)?.sqr()?.reshape((b, n))?.mean(1)?;
        Ok(match self.objective.snr_gamma {
            Some(g) => {
                let w: Vec<f32> = self
                    .schedule
                    .min_snr_weights(&timesteps, g)
                    .into_iter()
                    .map(|x| x as f32)
                    .collect();
                (mse * Tensor::from_vec(w, b, dev)?)?
            }
            None => mse,
        })
    }

    /// Mean loss over the first `loss_images` cached images at fixed noise and timesteps: the
    /// same draws at every evaluation, so values are comparable across steps.
    pub fn validation_loss(&self) -> Result<f64> {
        let n = self.eval.loss_images.min(self.cache.len());
        let mut total = 0f64;
        let first = EpochOrder {
            items: n,
            batch_size: self.batch_size,
            seed: self.seed,
            shuffle: false,
            grouping: Grouping::Buckets(latent_shapes(&self.cache, n)),
        };
        for batch in first.batches(0) {
            let l = self.per_sample_losses(
                &batch,
                self.seed ^ 0xE7A1 ^ batch[0] as u64,
                0,
                false,
                &Checkpointer::inference(),
            )?;
            // Only the value (each block's graph was freed as it returned).
            total += l.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        }
        Ok(total / n.max(1) as f64)
    }

    /// What evaluation generates with the weights in place: the sample images (written under
    /// `dir/step-N/`) and the MMD metrics.
    fn generate(
        &self,
        write_samples: bool,
        ledger: &mut Ledger,
        step: u64,
    ) -> Result<Vec<(String, f64)>> {
        let mut metrics = Vec::new();
        if write_samples {
            let images = self.sample_images(ledger, step)?;
            crate::data::write_pngs(&images, &self.eval.dir.join(format!("step-{step}")))?;
            metrics.push(("samples".into(), images.dim(0)? as f64));
        }
        if let Some(mmd) = &self.mmd {
            metrics.extend(mmd.evaluate(self, ledger, step)?);
        }
        Ok(metrics)
    }

    fn trainable(&self) -> Result<Vec<Var>> {
        Ok(self
            .store
            .trainable()?
            .into_iter()
            .map(|(_, v)| v)
            .collect())
    }
}

impl Task for SdxlTask {
    type Batch = Batch;

    fn start_epoch(&mut self, epoch: usize) -> TaskResult<()> {
        self.epochs.start(epoch, self.order.batches(epoch));
        Ok(())
    }

    fn next_batch(&mut self) -> TaskResult<Option<Batch>> {
        Ok(self.epochs.next_item())
    }

    fn skip_batch(&mut self) -> TaskResult<bool> {
        Ok(self.epochs.next_item().is_some())
    }

    fn counts(&self, batch: &Batch) -> (usize, usize) {
        (batch.len(), batch.len())
    }

    fn summed_loss(&mut self, batch: &Batch, ctx: &StepCtx) -> TaskResult<Tensor> {
        // The forward pass under the loop's checkpointer (per-block recompute when enabled).
        let losses = self.per_sample_losses(
            batch,
            ctx.dropout_seed,
            ctx.first_sample,
            true,
            ctx.checkpointer,
        )?;
        Ok(losses.sum_all()?)
    }

    fn split(&self, batch: &Batch) -> TaskResult<Option<(Batch, Batch)>> {
        Ok((batch.len() > 1).then(|| {
            let (a, b) = batch.split_at(batch.len() / 2);
            (a.to_vec(), b.to_vec())
        }))
    }

    fn after_step(&mut self, step: u64, weights: &[Var], ledger: &mut Ledger) -> TaskResult<()> {
        if let Some(ema) = &mut self.ema {
            ema.maybe_update(step, weights)?;
            ledger.set_on(Category::Ema, "unet", ema.bytes(), ema.device());
        }
        Ok(())
    }

    fn evaluate(&mut self, step: u64, ledger: &mut Ledger) -> TaskResult<Vec<(String, f64)>> {
        // No validation images (`--eval-images 0`): no validation loss to report.
        let loss = match self.eval.loss_images.min(self.cache.len()) {
            0 => None,
            _ => Some(self.validation_loss()?),
        };
        let mut metrics: Vec<(String, f64)> =
            loss.map(|l| ("loss".to_string(), l)).into_iter().collect();
        // No sample prompts (`--num-samples 0`) and no MMD: the validation loss alone.
        let write_samples = !self.cache.manifest.prompts.is_empty();
        if !write_samples && self.mmd.is_none() {
            // The other ranks wait to hear whether their shares of the EMA are wanted.
            if let Some(ema) = &self.ema {
                ema.decline()?;
            }
            return Ok(metrics);
        }
        let params = self.trainable()?;
        let stash = match &self.ema {
            Some(ema) => Some(ema.swap_in(&params)?),
            None => None,
        };
        // Whatever fails from here, the weights are restored first.
        let generated = match &stash {
            Some(_) => ledger
                .mark("eval/ema", step)
                .map(|_| ())
                .map_err(anyhow::Error::from),
            None => Ok(()),
        }
        .and_then(|()| self.generate(write_samples, ledger, step));
        if let Some(s) = stash {
            s.restore(&params)?;
        }
        metrics.extend(generated?);
        Ok(metrics)
    }

    fn save_model(&self, dir: &Path) -> TaskResult<()> {
        let weights = self.store.all();
        save_unet(&dir.join("unet"), &self.pipeline.unet_json, &weights)?;
        if let Some(ema) = &self.ema {
            // The other ranks' shares arrive one tensor at a time as the file is written.
            write_unet(&dir.join("unet_ema"), &self.pipeline.unet_json, |file| {
                Ok(ema.write(file)?)
            })?;
        }
        Ok(())
    }

    fn serve_evaluation(&mut self) -> TaskResult<()> {
        if let Some(ema) = &self.ema {
            ema.serve_evaluation()?;
        }
        Ok(())
    }

    fn serve_save(&self) -> TaskResult<()> {
        if let Some(ema) = &self.ema {
            ema.send()?;
        }
        Ok(())
    }

    fn data_state(&self) -> serde_json::Value {
        self.epochs.cursor().to_json()
    }

    fn restore_data_state(&mut self, s: &serde_json::Value) -> TaskResult<()> {
        let order = &self.order;
        self.epochs.restore(s, |epoch| order.batches(epoch))
    }
}

/// The latent shape of each of the first `n` cached images: their aspect buckets.
fn latent_shapes(cache: &Cache, n: usize) -> Vec<Vec<usize>> {
    cache.manifest.entries[..n]
        .iter()
        .map(|e| e.latent.to_vec())
        .collect()
}

/// Writes `unet/config.json` and `diffusion_pytorch_model.safetensors` into `dir` (diffusers'
/// layout: `UNet2DConditionModel.from_pretrained(dir)` loads it).
pub fn save_unet(
    dir: &Path,
    config: &serde_json::Value,
    tensors: &[(String, Tensor)],
) -> Result<()> {
    write_unet(dir, config, |file| {
        Ok(ft_params::fs::save_safetensors(tensors, file)?)
    })
}

/// [`save_unet`] with the weights file written by `weights` (given its path).
fn write_unet(
    dir: &Path,
    config: &serde_json::Value,
    weights: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| anyhow!("{}: {e}", dir.display()))?;
    weights(&dir.join("diffusion_pytorch_model.safetensors"))?;
    let text = serde_json::to_string_pretty(config)?;
    ft_params::fs::write_atomic(&dir.join("config.json"), |f| {
        std::io::Write::write_all(f, text.as_bytes())
    })?;
    Ok(())
}
