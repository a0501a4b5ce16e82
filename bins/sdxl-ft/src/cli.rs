//! sdxl-ft's command line (every flag is also a key of the `--config` TOML file). Names follow
//! diffusers' train_text_to_image_sdxl.py where it has one.

use std::path::PathBuf;

use clap::Parser;
use ft_trainer::train::fit::Knob;
use ft_trainer::train::{Binary, CommonArgs};
use serde::{Deserialize, Serialize};

/// Full fine-tune of the SDXL UNet with cached conditioning, EMA off the device and chunked VAE decode.
///
/// `--model` is a diffusers folder or hub id (model_index.json, unet/, vae/, text_encoder*/,
/// tokenizer*/, scheduler/). Each evaluation writes the validation loss and sample images.
/// `--demo` trains a tiny SDXL-shaped model on generated images (or on --data-dir).
#[derive(Parser, Serialize, Deserialize, Debug, Clone)]
#[command(version, about)]
pub struct Args {
    /// Weights variant: loads `*.{variant}.safetensors` (e.g. fp16) when the model has them.
    #[arg(long)]
    pub variant: Option<String>,
    /// Images with captions: metadata.jsonl (file_name, text) or a .txt file beside each image.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Caption field of metadata.jsonl.
    #[arg(long, default_value = "text")]
    pub caption_column: String,
    /// Training resolution in pixels (square; shortest side resized to it, then cropped).
    #[arg(long, default_value_t = 1024)]
    pub res: usize,
    /// Crop: center or random (random crops are drawn once, when the latent cache is built).
    #[arg(long, default_value = "center")]
    pub crop: String,
    /// Aspect-ratio buckets of about RES x RES pixels: each image is cut to the bucket nearest its
    /// aspect ratio instead of the square, and batches hold one bucket each (kohya's bucketing).
    #[arg(long)]
    pub aspect_buckets: bool,
    /// Bucket sides are multiples of this many pixels (default 64 from 512 px, else 8; rounded up
    /// to what the VAE and UNet need).
    #[arg(long)]
    pub bucket_step: Option<usize>,
    /// Also cache horizontally flipped latents and pick one of the two at random each time.
    #[arg(long)]
    pub random_flip: bool,
    /// Stop at the first unreadable image instead of skipping (and counting) it.
    #[arg(long)]
    pub strict_images: bool,
    /// Where the latent and embedding cache lives (default: OUTPUT_DIR/cache). Reused when the
    /// images, captions, model and settings are unchanged.
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Probability of training a sample on the empty caption (for classifier-free guidance).
    #[arg(
        long,
        visible_alias = "proportion-empty-prompts",
        default_value_t = 0.0
    )]
    pub caption_dropout: f64,
    /// Min-SNR-gamma loss weighting (5.0 is the paper's value); off when unset.
    #[arg(long)]
    pub snr_gamma: Option<f64>,
    /// Offset noise strength (0 disables).
    #[arg(long, default_value_t = 0.0)]
    pub noise_offset: f64,
    /// Override the scheduler's prediction type: epsilon or v_prediction.
    #[arg(long)]
    pub prediction_type: Option<String>,
    /// Keep an EMA of the UNet.
    #[arg(long)]
    pub ema: bool,
    /// EMA decay.
    #[arg(long, default_value_t = 0.9999)]
    pub ema_decay: f64,
    /// Fold the weights into the EMA every N optimizer steps.
    #[arg(long, default_value_t = 1)]
    pub ema_every: u64,
    /// Where the EMA lives: cpu (default, no device memory) or device.
    #[arg(long, default_value = "cpu")]
    pub ema_device: String,
    /// Validation loss over this many cached images, at fixed noise and timesteps (0: none).
    #[arg(long, default_value_t = 8)]
    pub eval_images: usize,
    /// Prompts for the evaluation samples (default: the first captions of the data).
    #[arg(long)]
    pub sample_prompt: Vec<String>,
    /// Sample images per evaluation when no --sample-prompt is given.
    #[arg(long, default_value_t = 4)]
    pub num_samples: usize,
    /// Sampler for evaluation images: euler or ddim.
    #[arg(long, default_value = "euler")]
    pub sampler: String,
    /// Denoising steps per sample.
    #[arg(long, default_value_t = 25)]
    pub sample_steps: usize,
    /// Classifier-free guidance scale (1 disables guidance).
    #[arg(long, default_value_t = 5.0)]
    pub guidance_scale: f64,
    /// Latents decoded per VAE call when writing samples.
    #[arg(long, default_value_t = 1)]
    pub vae_decode_chunk: usize,
    /// Decode sample latents in overlapping spatial tiles of this many latent pixels (diffusers'
    /// enable_tiling; e.g. 64 for 1024 px images); 0 decodes whole images.
    #[arg(long, default_value_t = 0)]
    pub vae_tile: usize,
    /// At each evaluation, generate this many samples from held-out captions and report KID and
    /// CMMD against as many held-out images (0: off).
    #[arg(long, default_value_t = 0)]
    pub eval_mmd_samples: usize,
    /// Held-out images with captions for --eval-mmd-samples (the --data-dir layout). Default:
    /// the first images of --data-dir, which training also sees.
    #[arg(long)]
    pub eval_data_dir: Option<PathBuf>,
    /// CLIP model (folder or hub id, e.g. openai/clip-vit-large-patch14) whose image embeddings
    /// the metric compares. Default: the latents pooled to 4 x 4 per channel (`kid_latent`).
    #[arg(long)]
    pub eval_clip_model: Option<String>,
    #[command(flatten)]
    #[serde(flatten)]
    pub common: CommonArgs,
}

impl Args {
    /// Rejects impossible settings with a message naming the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.common.validate()?;
        if self.res == 0 || !self.res.is_multiple_of(8) {
            anyhow::bail!(
                "--res {} must be a positive multiple of 8 (the VAE downsamples by 8)",
                self.res
            );
        }
        if self.bucket_step == Some(0) {
            anyhow::bail!("--bucket-step must be at least 1 pixel");
        }
        if self.vae_decode_chunk == 0 {
            anyhow::bail!("--vae-decode-chunk must be at least 1");
        }
        if self.vae_tile == 1 {
            anyhow::bail!("--vae-tile must be 0 (off) or at least 2 latent pixels");
        }
        if !["center", "random"].contains(&self.crop.as_str()) {
            anyhow::bail!("--crop `{}`: expected center or random", self.crop);
        }
        if !(0.0..=1.0).contains(&self.caption_dropout) {
            anyhow::bail!("--caption-dropout must be between 0 and 1");
        }
        if matches!(self.snr_gamma, Some(g) if !(g.is_finite() && g > 0.0)) {
            anyhow::bail!("--snr-gamma must be a positive number");
        }
        if !["cpu", "device"].contains(&self.ema_device.as_str()) {
            anyhow::bail!("--ema-device `{}`: expected cpu or device", self.ema_device);
        }
        if self.ema && !(0.0..1.0).contains(&self.ema_decay) {
            anyhow::bail!("--ema-decay must be in [0, 1)");
        }
        if self.ema_every == 0 {
            anyhow::bail!("--ema-every must be at least 1");
        }
        if self.sample_steps == 0 {
            anyhow::bail!("--sample-steps must be at least 1");
        }
        self.sampler.parse::<ft_models::sampling::SamplerKind>()?;
        if self.eval_mmd_samples == 1 {
            anyhow::bail!("--eval-mmd-samples must be 0 (off) or at least 2 (KID's estimate)");
        }
        if self.eval_mmd_samples == 0 {
            for (flag, set) in [
                ("--eval-data-dir", self.eval_data_dir.is_some()),
                ("--eval-clip-model", self.eval_clip_model.is_some()),
            ] {
                if set {
                    anyhow::bail!("{flag} is for the MMD metric: give --eval-mmd-samples N too");
                }
            }
        }
        // `--plan` reads the model's configs alone.
        if !self.common.demo && !self.common.plan && self.data_dir.is_none() {
            anyhow::bail!("--data-dir is required (or --demo for the bundled images)");
        }
        Ok(())
    }
}

impl Binary for Args {
    const DEFAULT_MODEL: Option<&'static str> = Some("stabilityai/stable-diffusion-xl-base-1.0");
    const DEMO: (&'static str, &'static str) = (
        "configs/sdxl_demo.toml (built in)",
        include_str!("../../../configs/sdxl_demo.toml"),
    );

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn common_mut(&mut self) -> &mut CommonArgs {
        &mut self.common
    }

    /// The EMA's fp32 copy moves to the host when the budget asks (after the checkpointing).
    fn fit_knobs(&self) -> Vec<Knob<Self>> {
        if !self.ema || self.ema_device == "cpu" || self.common.device == "cpu" {
            return Vec::new();
        }
        vec![Knob::new("EMA placement", &["ema_device"])
            .level("--ema-device cpu", |a: &mut Args| {
                a.ema_device = "cpu".into()
            })]
    }
}
