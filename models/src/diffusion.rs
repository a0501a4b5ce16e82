//! The DDPM training objective SDXL fine-tuning uses: the noise schedule from
//! `scheduler/scheduler_config.json`, noising, epsilon and v-prediction targets, min-SNR-gamma
//! loss weights, offset noise, and SDXL's micro-conditioning time ids.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use crate::error::{ModelError, Result};

fn d_steps() -> usize {
    1000
}
fn d_start() -> f64 {
    0.0001
}
fn d_end() -> f64 {
    0.02
}
fn d_schedule() -> String {
    "linear".into()
}
fn d_pred() -> String {
    "epsilon".into()
}

/// The fields of diffusers' DDPM/Euler `scheduler_config.json` the objective needs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SchedulerConfig {
    #[serde(default = "d_steps")]
    pub num_train_timesteps: usize,
    #[serde(default = "d_start")]
    pub beta_start: f64,
    #[serde(default = "d_end")]
    pub beta_end: f64,
    /// `linear` or `scaled_linear` (SDXL: scaled_linear, 0.00085 to 0.012).
    #[serde(default = "d_schedule")]
    pub beta_schedule: String,
    /// `epsilon` or `v_prediction`.
    #[serde(default = "d_pred")]
    pub prediction_type: String,
    /// Added to every inference timestep (SDXL: 1, with `leading` spacing).
    #[serde(default)]
    pub steps_offset: usize,
}

/// What the UNet is trained to predict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prediction {
    Epsilon,
    VPrediction,
}

/// The noise schedule: cumulative products of (1 - beta), in f64.
#[derive(Debug, Clone)]
pub struct NoiseSchedule {
    pub alphas_cumprod: Vec<f64>,
    pub prediction: Prediction,
    /// Inference timestep offset for the samplers.
    pub steps_offset: usize,
}

impl NoiseSchedule {
    pub fn from_file(path: &Path) -> Result<Self> {
        let cfg = crate::error::read_config::<SchedulerConfig>(path)?;
        Self::new(&cfg).map_err(|e| ModelError::Config {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
    }

    /// Betas as diffusers computes them (`scaled_linear`: a linear ramp of sqrt(beta), squared)
    /// and their cumulative alpha products (diffusers computes them in f32; f64 here differs
    /// by less than 1e-6 relative).
    pub fn new(cfg: &SchedulerConfig) -> Result<Self> {
        let n = cfg.num_train_timesteps;
        if n < 2 {
            return Err(ModelError::Invalid(
                "num_train_timesteps must be at least 2".into(),
            ));
        }
        let ramp = |a: f64, b: f64| (0..n).map(move |i| a + (b - a) * i as f64 / (n - 1) as f64);
        let betas: Vec<f64> = match cfg.beta_schedule.as_str() {
            "linear" => ramp(cfg.beta_start, cfg.beta_end).collect(),
            "scaled_linear" => ramp(cfg.beta_start.sqrt(), cfg.beta_end.sqrt())
                .map(|b| b * b)
                .collect(),
            other => {
                return Err(ModelError::Invalid(format!(
                    "beta_schedule `{other}` is not supported (linear, scaled_linear)"
                )))
            }
        };
        let prediction = match cfg.prediction_type.as_str() {
            "epsilon" => Prediction::Epsilon,
            "v_prediction" => Prediction::VPrediction,
            other => {
                return Err(ModelError::Invalid(format!(
                    "prediction_type `{other}` is not supported (epsilon, v_prediction)"
                )))
            }
        };
        let mut acp = Vec::with_capacity(n);
        let mut prod = 1.0;
        for b in betas {
            prod *= 1.0 - b;
            acp.push(prod);
        }
        Ok(NoiseSchedule {
            alphas_cumprod: acp,
            prediction,
            steps_offset: cfg.steps_offset,
        })
    }

    fn per_sample(&self, t: &[usize], f: impl Fn(f64) -> f64, device: &Device) -> Result<Tensor> {
        let v: Vec<f32> = t
            .iter()
            .map(|&i| self.alphas_cumprod.get(i).map(|a| f(*a) as f32))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                ModelError::Invalid(format!(
                    "a timestep of {t:?} is past the schedule's {} steps",
                    self.alphas_cumprod.len()
                ))
            })?;
        Ok(Tensor::from_vec(v, (t.len(), 1, 1, 1), device)?)
    }

    /// `sqrt(acp_t) x0 + sqrt(1 - acp_t) noise` for per-sample timesteps `t` (x0, noise [B, C, H, W]).
    pub fn add_noise(&self, x0: &Tensor, noise: &Tensor, t: &[usize]) -> Result<Tensor> {
        let a = self
            .per_sample(t, f64::sqrt, x0.device())?
            .to_dtype(x0.dtype())?;
        let s = self
            .per_sample(t, |a| (1.0 - a).sqrt(), x0.device())?
            .to_dtype(x0.dtype())?;
        Ok((x0.broadcast_mul(&a)? + noise.broadcast_mul(&s)?)?)
    }

    /// The training target: the noise (epsilon) or `sqrt(acp) noise - sqrt(1 - acp) x0` (v).
    pub fn target(&self, x0: &Tensor, noise: &Tensor, t: &[usize]) -> Result<Tensor> {
        match self.prediction {
            Prediction::Epsilon => Ok(noise.clone()),
            Prediction::VPrediction => {
                let a = self
                    .per_sample(t, f64::sqrt, x0.device())?
                    .to_dtype(x0.dtype())?;
                let s = self
                    .per_sample(t, |a| (1.0 - a).sqrt(), x0.device())?
                    .to_dtype(x0.dtype())?;
                Ok((noise.broadcast_mul(&a)? - x0.broadcast_mul(&s)?)?)
            }
        }
    }

    /// Signal-to-noise ratio `acp / (1 - acp)` at `t`.
    pub fn snr(&self, t: usize) -> f64 {
        let a = self.alphas_cumprod.get(t).copied().unwrap_or(0.0);
        a / (1.0 - a)
    }

    /// Min-SNR-gamma loss weights (Hang et al. 2023, as diffusers' training scripts compute them):
    /// `min(snr, gamma) / snr` for epsilon, `min(snr, gamma) / (snr + 1)` for v-prediction.
    pub fn min_snr_weights(&self, t: &[usize], gamma: f64) -> Vec<f64> {
        t.iter()
            .map(|&i| {
                let snr = self.snr(i);
                let w = snr.min(gamma);
                match self.prediction {
                    Prediction::Epsilon => w / snr,
                    Prediction::VPrediction => w / (snr + 1.0),
                }
            })
            .collect()
    }
}

/// Offset noise: `noise + offset * n` with `n` of shape [B, C, 1, 1] (one value per channel and
/// image), which lets the model learn overall brightness.
pub fn offset_noise(noise: &Tensor, offset: f64, per_channel: &Tensor) -> Result<Tensor> {
    Ok(noise.broadcast_add(&(per_channel * offset)?)?)
}

/// SDXL's micro-conditioning: (original height, width, crop top, left, target height, width).
pub fn time_ids(
    original: (usize, usize),
    crop_top_left: (usize, usize),
    target: (usize, usize),
    device: &Device,
) -> Result<Tensor> {
    let v = [
        original.0,
        original.1,
        crop_top_left.0,
        crop_top_left.1,
        target.0,
        target.1,
    ]
    .map(|x| x as f32);
    Ok(Tensor::new(&v, device)?.to_dtype(DType::F32)?)
}
