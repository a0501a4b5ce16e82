//! Inference samplers for evaluation images: diffusers' `EulerDiscreteScheduler` (SDXL's default)
//! and `DDIMScheduler` (eta 0), both with `leading` timestep spacing and the schedule's
//! `steps_offset`, so samples written during fine-tuning look like the pipeline's.

use candle_core::Tensor;

use crate::diffusion::{NoiseSchedule, Prediction};
use crate::error::{ModelError, Result};

/// Which update rule turns the model's prediction into the next latents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplerKind {
    Euler,
    Ddim,
}

impl std::str::FromStr for SamplerKind {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "euler" => Ok(SamplerKind::Euler),
            "ddim" => Ok(SamplerKind::Ddim),
            other => Err(ModelError::Invalid(format!(
                "sampler `{other}` is not known (euler, ddim)"
            ))),
        }
    }
}

/// The timesteps and per-step coefficients of one sampling run.
#[derive(Debug, Clone)]
pub struct Sampler {
    kind: SamplerKind,
    timesteps: Vec<usize>,
    /// Euler: sigma at each timestep, plus a final 0.
    sigmas: Vec<f64>,
    acp: Vec<f64>,
    step_ratio: usize,
    prediction: Prediction,
}

impl Sampler {
    /// `steps` inference steps over `schedule`'s training timesteps.
    pub fn new(kind: SamplerKind, schedule: &NoiseSchedule, steps: usize) -> Result<Self> {
        let n = schedule.alphas_cumprod.len();
        if steps == 0 || steps > n {
            return Err(ModelError::Invalid(format!(
                "{steps} sampling steps: must be between 1 and the schedule's {n}"
            )));
        }
        let step_ratio = n / steps;
        let timesteps: Vec<usize> = (0..steps)
            .rev()
            .map(|i| (i * step_ratio + schedule.steps_offset).min(n - 1))
            .collect();
        let acp = schedule.alphas_cumprod.clone();
        let mut sigmas: Vec<f64> = timesteps
            .iter()
            .map(|&t| ((1.0 - acp[t]) / acp[t]).sqrt())
            .collect();
        sigmas.push(0.0);
        Ok(Sampler {
            kind,
            timesteps,
            sigmas,
            acp,
            step_ratio,
            prediction: schedule.prediction,
        })
    }

    /// Timesteps the model is called at, from noisiest to cleanest.
    pub fn timesteps(&self) -> &[usize] {
        &self.timesteps
    }

    /// Standard deviation of the initial latents (Euler with `leading` spacing: sqrt(sigma_max^2 + 1)).
    pub fn init_noise_sigma(&self) -> f64 {
        match self.kind {
            SamplerKind::Euler => (self.sigmas[0].powi(2) + 1.0).sqrt(),
            SamplerKind::Ddim => 1.0,
        }
    }

    /// The model input at step `i` (Euler divides by sqrt(sigma^2 + 1); DDIM leaves it).
    pub fn scale_input(&self, x: &Tensor, i: usize) -> Result<Tensor> {
        match self.kind {
            SamplerKind::Euler => Ok((x / (self.sigmas[i].powi(2) + 1.0).sqrt())?),
            SamplerKind::Ddim => Ok(x.clone()),
        }
    }

    /// Latents after step `i`, given the model's output for the scaled input.
    pub fn step(&self, model_out: &Tensor, i: usize, x: &Tensor) -> Result<Tensor> {
        match self.kind {
            SamplerKind::Euler => {
                let sigma = self.sigmas[i];
                let x0 = match self.prediction {
                    Prediction::Epsilon => (x - (model_out * sigma)?)?,
                    Prediction::VPrediction => {
                        let s2 = sigma * sigma + 1.0;
                        ((model_out * (-sigma / s2.sqrt()))? + (x / s2)?)?
                    }
                };
                let derivative = ((x - x0)? / sigma)?;
                Ok((x + (derivative * (self.sigmas[i + 1] - sigma))?)?)
            }
            SamplerKind::Ddim => {
                let t = self.timesteps[i];
                let a = self.acp[t];
                // diffusers' `set_alpha_to_one=False` (SDXL): the last step lands on acp[0].
                let a_prev = t
                    .checked_sub(self.step_ratio)
                    .map(|p| self.acp[p])
                    .unwrap_or(self.acp[0]);
                let (x0, eps) = match self.prediction {
                    Prediction::Epsilon => (
                        ((x - (model_out * (1.0 - a).sqrt())?)? / a.sqrt())?,
                        model_out.clone(),
                    ),
                    Prediction::VPrediction => (
                        ((x * a.sqrt())? - (model_out * (1.0 - a).sqrt())?)?,
                        ((model_out * a.sqrt())? + (x * (1.0 - a).sqrt())?)?,
                    ),
                };
                Ok(((x0 * a_prev.sqrt())? + (eps * (1.0 - a_prev).sqrt())?)?)
            }
        }
    }
}
