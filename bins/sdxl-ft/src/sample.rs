//! Generation from the UNet being trained: one latent at a time from seeded noise with
//! classifier-free guidance, decoded by the VAE in chunks. The evaluation's sample images and the
//! MMD's generated set both come from here.

use anyhow::{anyhow, Result};
use candle_core::{DType, Tensor};
use ft_models::sampling::Sampler;
use ft_models::vae::{Vae, VaeParts};
use ft_params::checkpoint::Checkpointer;
use ft_params::rng::SplitMix64;
use ft_trainer::ledger::Ledger;

use crate::task::{normal, SdxlTask};

/// What one latent is generated from.
pub struct Prompt {
    /// The caption's index in the cache's texts.
    pub caption: usize,
    /// The latent's [channels, height, width].
    pub latent: [usize; 3],
    /// The image's (height, width) in pixels: SDXL's original and target size time ids.
    pub size: (usize, usize),
    /// Seeds the starting noise.
    pub seed: u64,
}

impl SdxlTask {
    /// The sampler the evaluation settings name.
    pub fn sampler(&self) -> Result<Sampler> {
        Ok(Sampler::new(
            self.eval.sampler,
            &self.schedule,
            self.eval.steps,
        )?)
    }

    /// Denoises one latent for `p` with `texts` (a cache holding its caption) from noise:
    /// [1, C, h, w] f32, detached.
    pub fn denoise(
        &self,
        texts: &crate::cache::Cache,
        p: &Prompt,
        sampler: &Sampler,
    ) -> Result<Tensor> {
        let [c, h, w] = p.latent;
        let dev = &self.device;
        let guided = self.eval.guidance_scale != 1.0;
        let (ph, pw) = (p.size.0 as f32, p.size.1 as f32);
        let ids = Tensor::new(&[ph, pw, 0.0, 0.0, ph, pw], dev)?
            .to_dtype(self.dtype)?
            .unsqueeze(0)?;
        // Each UNet block's graph freed as the block returns (no gradient comes here).
        let ck = Checkpointer::inference();
        let (hs, pooled) = texts.text(p.caption, self.dtype, dev)?;
        let (ctx, pool, tid) = if guided {
            let (uh, up) = if self.pipeline.force_zeros_for_empty_prompt {
                (hs.zeros_like()?, pooled.zeros_like()?)
            } else {
                texts.text(texts.manifest.empty, self.dtype, dev)?
            };
            (
                Tensor::stack(&[&uh, &hs], 0)?,
                Tensor::stack(&[&up, &pooled], 0)?,
                Tensor::cat(&[&ids, &ids], 0)?,
            )
        } else {
            (hs.unsqueeze(0)?, pooled.unsqueeze(0)?, ids)
        };
        let mut rng = SplitMix64::new(p.seed);
        let noise = Tensor::from_vec(normal(&mut rng, c * h * w), (1, c, h, w), dev)?;
        let mut x = (noise * sampler.init_noise_sigma())?;
        for (i, &t) in sampler.timesteps().iter().enumerate() {
            let xin = sampler.scale_input(&x, i)?.to_dtype(self.dtype)?;
            let xin = if guided {
                Tensor::cat(&[&xin, &xin], 0)?
            } else {
                xin
            };
            let n = xin.dim(0)?;
            let out = self
                .unet
                .forward(&xin, &vec![t as f32; n], &ctx, Some((&pool, &tid)), &ck)?
                .to_dtype(DType::F32)?;
            let out = if guided {
                let (u, cnd) = (out.get(0)?, out.get(1)?);
                (&u + ((cnd - &u)? * self.eval.guidance_scale)?)?.unsqueeze(0)?
            } else {
                out
            };
            // Detached: otherwise each step's graph would keep every earlier step's
            // activations alive through the UNet's trainable weights.
            x = sampler.step(&out.detach(), i, &x)?.detach();
        }
        Ok(x)
    }

    /// The VAE decoder in the dtype samples are decoded in.
    pub fn decoder(&self) -> Result<Vae> {
        self.pipeline
            .vae(VaeParts::Decoder, self.vae_dtype(), &self.device)
    }

    /// SDXL's VAE overflows in f16: it decodes in f32 then.
    fn vae_dtype(&self) -> DType {
        if self.dtype == DType::F16 {
            DType::F32
        } else {
            self.dtype
        }
    }

    /// Images [N, 3, H, W] in [-1, 1] from latents [N, C, h, w], decoded `vae_decode_chunk`
    /// latents per call (spatially tiled with `vae_tile`).
    pub fn decode(&self, vae: &Vae, latents: &Tensor) -> Result<Tensor> {
        let images = vae.decode_chunked(
            &latents.to_dtype(self.vae_dtype())?,
            self.eval.vae_decode_chunk,
            self.eval.vae_tile,
        )?;
        Ok(images.clamp(-1f32, 1f32)?)
    }

    /// Sample images for the cached prompts with classifier-free guidance, decoded in chunks of
    /// `vae_decode_chunk` and moved to the host chunk by chunk. [N, 3, H, W] on the host.
    pub fn sample_images(&self, ledger: &mut Ledger, step: u64) -> Result<Tensor> {
        let prompts = &self.cache.manifest.prompts;
        if prompts.is_empty() {
            return Err(anyhow!("no sample prompts in the cache"));
        }
        let sampler = self.sampler()?;
        let latent = self.cache.manifest.latent_shape;
        let r = self.cache.manifest.res;
        let mut latents = Vec::with_capacity(prompts.len());
        for (k, &caption) in prompts.iter().enumerate() {
            let p = Prompt {
                caption,
                latent,
                size: (r, r),
                seed: self.seed ^ 0x5A3F ^ k as u64,
            };
            latents.push(self.denoise(&self.cache, &p, &sampler)?);
        }
        ledger.mark("eval/denoised", step)?;
        let latents = Tensor::cat(&latents, 0)?;
        let vae = self.decoder()?;
        let images = self.decode(&vae, &latents)?;
        drop(vae);
        ledger.mark("eval/decoded", step)?;
        Ok(images)
    }
}
