//! The demo's VAE, fitted to the demo's kind of images so its samples show shapes: a VAE with
//! random weights decodes any latent to coloured noise, and a new user could not tell a working
//! run from a broken one.
//!
//! The fit is an autoencoder's: each step draws fresh scenes ([`random_batch`]), encodes them to
//! the posterior mean, adds Gaussian noise of [`POSTERIOR_STD`] times the batch's latent spread
//! (so the decoder also decodes latents near the encoded ones, as the UNet's are), decodes, and
//! takes AdamW on the pixel MSE. Afterwards, as Stable Diffusion's `scaling_factor` was chosen,
//! `scaling_factor` is 1 / the latents' standard deviation over fresh scenes, and the posterior's
//! log-variance is the constant the training noise had (the `quant_conv` rows that give it are
//! set so). `cargo run -p sdxl-ft --release --example fit_demo_vae` writes the result to
//! `bins/sdxl-ft/assets/demo-vae/`, which the demo embeds: fitting at every demo start would cost
//! each test that builds the demo too.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use ft_models::vae::{Vae, VaeConfig};
use ft_params::rng::SplitMix64;
use ft_params::{ParamBuilder, ParamStore};
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer};
use serde_json::json;

use super::images::random_batch;

/// The demo's resolution: the VAE is fitted at it.
pub const SIZE: usize = 32;

/// The posterior's standard deviation relative to the latents' spread.
pub const POSTERIOR_STD: f64 = 0.1;

/// The demo VAE's `vae/config.json`: three levels (32 px images, 8 x 8 x 4 latents) at
/// `scaling_factor`.
pub fn config(scaling_factor: f64) -> serde_json::Value {
    json!({
        "_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
        "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"],
        "block_out_channels": [8, 16, 16], "layers_per_block": 1, "latent_channels": 4,
        "norm_num_groups": 4, "sample_size": SIZE, "scaling_factor": scaling_factor,
    })
}

/// How the fit went.
#[derive(Debug, Clone, Copy)]
pub struct FitReport {
    pub steps: usize,
    /// Pixel MSE (images in [-1, 1]) of the first and the last step.
    pub first_mse: f64,
    pub last_mse: f64,
    pub scaling_factor: f64,
}

/// A fitted VAE: its weights and its config.
pub struct Fitted {
    pub store: Arc<ParamStore>,
    pub config: serde_json::Value,
    pub report: FitReport,
}

/// Fits the demo VAE for `steps` steps of `batch` scenes at learning rate `lr` (cosine to zero),
/// everything drawn from `seed`; `log` sees each step's MSE.
pub fn fit(
    steps: usize,
    batch: usize,
    lr: f64,
    seed: u64,
    mut log: impl FnMut(usize, f64),
) -> Result<Fitted> {
    let dev = Device::Cpu;
    let store = ParamStore::new();
    let cfg: VaeConfig = serde_json::from_value(config(1.0))?;
    let vae = Vae::new(
        &ParamBuilder::new(store.clone(), DType::F32, &dev, seed),
        &cfg,
    )?;
    let (names, params): (Vec<String>, Vec<Var>) = store.trainable()?.into_iter().unzip();
    let mut opt = AdamW::new(
        params.len(),
        AdamWConfig {
            weight_decay: 0.0,
            ..AdamWConfig::default()
        },
    );
    let mut rng = SplitMix64::new(seed ^ 0xFA7E);
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for step in 0..steps {
        let x = random_batch(&mut rng, batch, SIZE)?;
        let (mean, _) = vae.encode_moments(&x)?;
        let spread = f64::from(mean.detach().flatten_all()?.var(0)?.to_scalar::<f32>()?).sqrt();
        let noise = normal(&mut rng, mean.dims(), POSTERIOR_STD * spread)?;
        let y = vae.decode(&(mean + noise)?)?;
        let mse = (y - &x)?.sqr()?.mean_all()?;
        let value = f64::from(mse.to_scalar::<f32>()?);
        if step == 0 {
            first = value;
        }
        last = value;
        log(step, value);
        let grads = mse.backward()?;
        let grads: Vec<Option<Tensor>> = params.iter().map(|p| grads.get(p).cloned()).collect();
        let t = step as f64 / steps.max(1) as f64;
        let rate = lr * 0.5 * (1.0 + (std::f64::consts::PI * t).cos());
        opt.step_host(&params, &grads, rate, 1.0)?;
    }
    // Latent spread over fresh scenes gives the scaling factor; the posterior's log-variance is
    // the training noise's.
    let x = random_batch(&mut rng, 256, SIZE)?;
    let (mean, _) = vae.encode_moments(&x)?;
    let spread = f64::from(mean.flatten_all()?.var(0)?.to_scalar::<f32>()?).sqrt();
    let logvar = 2.0 * (POSTERIOR_STD * spread).ln();
    set_constant_logvar(&names, &params, cfg.latent_channels, logvar)?;
    Ok(Fitted {
        store,
        config: config(1.0 / spread),
        report: FitReport {
            steps,
            first_mse: first,
            last_mse: last,
            scaling_factor: 1.0 / spread,
        },
    })
}

/// Gaussian noise of standard deviation `std` from `rng` (candle's own `randn` is not seeded).
fn normal(rng: &mut SplitMix64, shape: &[usize], std: f64) -> Result<Tensor> {
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| (rng.normal() * std) as f32).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// Makes `quant_conv`'s log-variance half output `logvar` whatever the image: its weight rows
/// zero, its bias the constant.
fn set_constant_logvar(names: &[String], params: &[Var], lc: usize, logvar: f64) -> Result<()> {
    let find = |n: &str| {
        names
            .iter()
            .position(|m| m == n)
            .map(|i| &params[i])
            .with_context(|| format!("the demo VAE has no {n}"))
    };
    let w = find("quant_conv.weight")?;
    let rows = w.narrow(0, 0, lc)?;
    w.set(&Tensor::cat(&[&rows, &rows.zeros_like()?], 0)?)?;
    let b = find("quant_conv.bias")?;
    let means = b.narrow(0, 0, lc)?;
    let constant = Tensor::full(logvar as f32, lc, &Device::Cpu)?;
    b.set(&Tensor::cat(&[&means, &constant], 0)?)?;
    Ok(())
}

/// Writes a fitted VAE as a diffusers `vae/` folder (config.json,
/// diffusion_pytorch_model.safetensors).
pub fn write(fitted: &Fitted, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    super::write_json(&dir.join("config.json"), &fitted.config)?;
    ft_params::fs::save_safetensors(
        &fitted.store.all(),
        &dir.join("diffusion_pytorch_model.safetensors"),
    )?;
    Ok(())
}

/// Encodes `n` fresh scenes with the VAE in `dir` and decodes them back; writes the originals
/// above their reconstructions as one PNG at `png` and returns the reconstructions' PSNR (dB,
/// on the [0, 255] pixels), so a fit can be judged by eye and by number.
pub fn preview(dir: &Path, n: usize, png: &Path) -> Result<f64> {
    let dev = Device::Cpu;
    let cfg = VaeConfig::from_file(&dir.join("config.json"))?;
    let files = Arc::new(ft_params::weights::SafetensorsFiles::open(&[
        dir.join("diffusion_pytorch_model.safetensors")
    ])?);
    let pb = ParamBuilder::new(ParamStore::new(), DType::F32, &dev, 0)
        .with_source(files)
        .frozen();
    let vae = Vae::new(&pb, &cfg)?;
    let x = random_batch(&mut SplitMix64::new(0x5EE), n, SIZE)?;
    let y = vae.decode(&vae.encode(&x)?)?.clamp(-1f32, 1f32)?;
    let to_u8 = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(((t + 1.0)? * 127.5)?.round()?.flatten_all()?.to_vec1()?)
    };
    let (a, b) = (to_u8(&x)?, to_u8(&y)?);
    let mse = a
        .iter()
        .zip(&b)
        .map(|(p, q)| (p - q).powi(2) as f64)
        .sum::<f64>()
        / a.len() as f64;
    let s = SIZE as u32;
    let img = image::RgbImage::from_fn(s * n as u32, 2 * s, |x, y| {
        let (i, row, px, py) = ((x / s) as usize, y / s, (x % s) as usize, (y % s) as usize);
        let src = if row == 0 { &a } else { &b };
        let at = |c: usize| src[((i * 3 + c) * SIZE + py) * SIZE + px] as u8;
        image::Rgb([at(0), at(1), at(2)])
    });
    img.save(png).with_context(|| png.display().to_string())?;
    Ok(10.0 * (255f64 * 255.0 / mse.max(1e-12)).log10())
}
