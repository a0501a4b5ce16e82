//! The diffusers folder layout of an SDXL model, from a path or a hub id: model_index.json and
//! the configs of unet/, vae/, text_encoder/, text_encoder_2/, tokenizer*/ and scheduler/.
//! Opening reads only configs; each component's weights are loaded when the run needs them (the
//! text encoders and the VAE encoder only while the cache is built).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use candle_core::{DType, Device};
use ft_models::clip::{ClipTextConfig, ClipTextModel};
use ft_models::diffusion::NoiseSchedule;
use ft_models::unet::UNetConfig;
use ft_models::vae::{Vae, VaeConfig, VaeParts};
use ft_params::weights::SafetensorsFiles;
use ft_params::{ParamBuilder, ParamStore};
use ft_trainer::train::ModelRepo;

use crate::tokenize::ClipTokenizer;

/// A JSON file as a value; errors name the file.
fn read_json(path: &std::path::Path) -> Result<serde_json::Value> {
    Ok(ft_models::error::read_config(path)?)
}

/// An SDXL pipeline's configs and where its files are.
pub struct Pipeline {
    pub repo: ModelRepo,
    pub variant: Option<String>,
    /// SDXL base: the unconditional branch of guidance uses zero embeddings, not the empty prompt's.
    pub force_zeros_for_empty_prompt: bool,
    pub unet: UNetConfig,
    /// unet/config.json as written, saved beside fine-tuned weights so diffusers loads them.
    pub unet_json: serde_json::Value,
    pub vae: VaeConfig,
    pub text_encoder: ClipTextConfig,
    pub text_encoder_2: ClipTextConfig,
    pub schedule: NoiseSchedule,
}

impl Pipeline {
    /// Reads model_index.json and every component's config; checks that the UNet's conditioning
    /// sizes agree with the text encoders.
    pub fn open(spec: &str, variant: Option<String>) -> Result<Self> {
        let repo = ModelRepo::open(spec)?;
        let index_path = repo.get("model_index.json")?;
        let index = read_json(&index_path)?;
        for part in [
            "unet",
            "vae",
            "text_encoder",
            "text_encoder_2",
            "tokenizer",
            "tokenizer_2",
            "scheduler",
        ] {
            if index.get(part).is_none() {
                return Err(anyhow!(
                    "{}: no `{part}` component (an SDXL pipeline has unet, vae, two text encoders, two tokenizers and a scheduler)",
                    index_path.display()
                ));
            }
        }
        let unet_path = repo.get("unet/config.json")?;
        let unet_json = read_json(&unet_path)?;
        let unet = UNetConfig::from_file(&unet_path)?;
        let vae = VaeConfig::from_file(&repo.get("vae/config.json")?)?;
        let text_encoder = ClipTextConfig::from_file(&repo.get("text_encoder/config.json")?)?;
        let text_encoder_2 = ClipTextConfig::from_file(&repo.get("text_encoder_2/config.json")?)?;
        let schedule = NoiseSchedule::from_file(&repo.get("scheduler/scheduler_config.json")?)?;
        let p = Pipeline {
            force_zeros_for_empty_prompt: index
                .get("force_zeros_for_empty_prompt")
                .and_then(|v| v.as_bool())
                .unwrap_or(true),
            repo,
            variant,
            unet,
            unet_json,
            vae,
            text_encoder,
            text_encoder_2,
            schedule,
        };
        p.check(&unet_path)?;
        Ok(p)
    }

    fn check(&self, unet_path: &std::path::Path) -> Result<()> {
        let ctx = self.text_encoder.hidden_size + self.text_encoder_2.hidden_size;
        if self.unet.cross_attention_dim != ctx {
            return Err(anyhow!(
                "{}: cross_attention_dim {} but the text encoders give {} + {} = {ctx}",
                unet_path.display(),
                self.unet.cross_attention_dim,
                self.text_encoder.hidden_size,
                self.text_encoder_2.hidden_size
            ));
        }
        if self.unet.addition_embed_type.as_deref() != Some("text_time") {
            return Err(anyhow!(
                "{}: addition_embed_type must be text_time (an SDXL UNet)",
                unet_path.display()
            ));
        }
        let want =
            self.text_encoder_2.projection_dim + 6 * self.unet.addition_time_embed_dim.unwrap_or(0);
        if self.unet.projection_class_embeddings_input_dim != Some(want) {
            return Err(anyhow!(
                "{}: projection_class_embeddings_input_dim {:?} but the pooled text ({}) and six time ids give {want}",
                unet_path.display(),
                self.unet.projection_class_embeddings_input_dim,
                self.text_encoder_2.projection_dim
            ));
        }
        if self.unet.in_channels != self.vae.latent_channels {
            return Err(anyhow!(
                "{}: in_channels {} but the VAE has {} latent channels",
                unet_path.display(),
                self.unet.in_channels,
                self.vae.latent_channels
            ));
        }
        Ok(())
    }

    /// Pixels per latent pixel (8 for SDXL's four-level VAE).
    pub fn vae_factor(&self) -> usize {
        1 << self.vae.block_out_channels.len().saturating_sub(1)
    }

    /// Latent pixels per bottleneck pixel of the UNet (4 for SDXL's three levels): latent sides
    /// must be multiples of it.
    pub fn unet_factor(&self) -> usize {
        1 << self.unet.block_out_channels.len().saturating_sub(1)
    }

    /// The weights of `folder` (`{stem}.{variant}.safetensors` first when a variant is asked for).
    pub fn weights(&self, folder: &str, stem: &str) -> Result<SafetensorsFiles> {
        if let Some(v) = &self.variant {
            // A variant the model lacks falls back; a failure to tell is an error.
            if let Some(f) = self
                .repo
                .safetensors_if_available(&format!("{folder}/{stem}.{v}"))?
            {
                return Ok(f);
            }
            tracing::warn!("{folder}: no `{v}` variant, loading the default weights");
        }
        Ok(self.repo.safetensors(&format!("{folder}/{stem}"))?)
    }

    /// A frozen text encoder (`1` or `2`) in `dtype` on `device`.
    pub fn text_encoder(&self, which: u8, dtype: DType, device: &Device) -> Result<ClipTextModel> {
        let (folder, cfg, proj) = match which {
            1 => ("text_encoder", &self.text_encoder, false),
            _ => ("text_encoder_2", &self.text_encoder_2, true),
        };
        let files = Arc::new(self.weights(folder, "model")?);
        let pb = ParamBuilder::new(ParamStore::new(), dtype, device, 0)
            .frozen()
            .with_source(files);
        Ok(ClipTextModel::new(&pb, cfg, proj)?)
    }

    /// The frozen VAE halves in `parts`.
    pub fn vae(&self, parts: VaeParts, dtype: DType, device: &Device) -> Result<Vae> {
        let files = Arc::new(self.weights("vae", "diffusion_pytorch_model")?);
        let pb = ParamBuilder::new(ParamStore::new(), dtype, device, 0)
            .frozen()
            .with_source(files);
        Ok(Vae::with_parts(&pb, &self.vae, parts)?)
    }

    /// The tokenizer of `tokenizer/` (1) or `tokenizer_2/` (2), capped at its encoder's positions.
    pub fn tokenizer(&self, which: u8) -> Result<ClipTokenizer> {
        let (folder, cfg) = match which {
            1 => ("tokenizer", &self.text_encoder),
            _ => ("tokenizer_2", &self.text_encoder_2),
        };
        // Fetch the optional files first so a hub snapshot folder holds them all (absent ones
        // are fine; a failure to tell is an error).
        for f in ["special_tokens_map.json", "tokenizer_config.json"] {
            self.repo.find_if_available(&format!("{folder}/{f}"))?;
        }
        let dir: PathBuf = match self
            .repo
            .find_if_available(&format!("{folder}/tokenizer.json"))?
        {
            Some(p) => p,
            None => self.repo.get(&format!("{folder}/vocab.json"))?,
        }
        .parent()
        .map(|p| p.to_path_buf())
        .ok_or_else(|| anyhow!("{folder}: no parent folder"))?;
        if !dir.join("tokenizer.json").is_file() {
            self.repo.get(&format!("{folder}/merges.txt"))?;
        }
        ClipTokenizer::from_dir(&dir, cfg.max_position_embeddings)
    }
}
