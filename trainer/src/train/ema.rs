//! An exponential moving average of the trained weights that does not double device memory.
//!
//! The average is kept in fp32 on the host by default (seed 003: an EMA copy on the GPU is a whole
//! second model). It is updated every `every` optimizer steps from the fp32 master weights (or the
//! weights themselves when they are fp32), one tensor at a time, so the device only ever holds one
//! parameter's worth of transfer. Evaluation swaps the averaged values into the model's own
//! parameters and back ([`Ema::swap_in`]), so no second model exists on the device then either.

use candle_core::{DType, Device, Tensor, Var};

use crate::error::{Error, Result};

/// The moving average of a list of parameters.
pub struct Ema {
    names: Vec<String>,
    shadow: Vec<Tensor>,
    decay: f64,
    every: u64,
    device: Device,
}

/// The model's own values while the average is swapped in; [`Stash::restore`] puts them back.
pub struct Stash {
    values: Vec<Tensor>,
}

impl Ema {
    /// Starts the average at the current values of `params` (fp32 copies on `device`).
    pub fn new(
        names: &[String],
        params: &[Var],
        decay: f64,
        every: u64,
        device: &Device,
    ) -> Result<Self> {
        if !(0.0..1.0).contains(&decay) {
            return Err(Error::Invalid(format!(
                "EMA decay {decay} must be in [0, 1)"
            )));
        }
        if every == 0 {
            return Err(Error::Invalid(
                "EMA update interval must be at least 1".into(),
            ));
        }
        if names.len() != params.len() {
            return Err(Error::Invalid(format!(
                "EMA: {} names for {} parameters",
                names.len(),
                params.len()
            )));
        }
        let shadow = params
            .iter()
            .map(|p| Ok(detached_copy(p.as_tensor(), device)?.to_dtype(DType::F32)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Ema {
            names: names.to_vec(),
            shadow,
            decay,
            every,
            device: device.clone(),
        })
    }

    /// The decay applied at an update after `step` optimizer steps: diffusers' `EMAModel` warmup
    /// `min(decay, (1 + step) / (10 + step))`, raised to the power `every` so that updating every
    /// N steps averages over the same number of steps as updating every step would.
    pub fn decay_at(&self, step: u64) -> f64 {
        let s = step as f64;
        self.decay
            .min((1.0 + s) / (10.0 + s))
            .powi(self.every as i32)
    }

    /// Folds `params` into the average when `step` is a multiple of the interval; true if it did.
    pub fn maybe_update(&mut self, step: u64, params: &[Var]) -> Result<bool> {
        if !step.is_multiple_of(self.every) {
            return Ok(false);
        }
        if params.len() != self.shadow.len() {
            return Err(Error::Invalid(format!(
                "EMA holds {} tensors, asked to update from {}",
                self.shadow.len(),
                params.len()
            )));
        }
        let d = self.decay_at(step);
        for (s, p) in self.shadow.iter_mut().zip(params) {
            // Detached: the weights are Vars, and an op on a Var records its inputs, so each
            // new average would keep the previous one alive (a chain as long as the run).
            let p = p
                .as_tensor()
                .detach()
                .to_device(&self.device)?
                .to_dtype(DType::F32)?;
            *s = ((&*s * d)? + (p * (1.0 - d))?)?.detach();
        }
        Ok(true)
    }

    /// Bytes the average holds (fp32).
    pub fn bytes(&self) -> u64 {
        self.shadow
            .iter()
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The averaged tensors with their parameter names.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .cloned()
            .zip(self.shadow.iter().cloned())
            .collect()
    }

    /// Replaces the average with saved tensors (resume); every name must be present.
    pub fn load(&mut self, get: impl Fn(&str, &[usize]) -> Result<Tensor>) -> Result<()> {
        for (name, s) in self.names.iter().zip(self.shadow.iter_mut()) {
            let t = get(name, s.dims())?;
            *s = t.to_dtype(DType::F32)?.to_device(&self.device)?;
        }
        Ok(())
    }

    /// Writes the average into `params` (cast to their dtype and device), returning the values it
    /// replaced, kept on the host. One parameter is in flight on the device at a time.
    pub fn swap_in(&self, params: &[Var]) -> Result<Stash> {
        if params.len() != self.shadow.len() {
            return Err(Error::Invalid(format!(
                "EMA holds {} tensors, the model has {}",
                self.shadow.len(),
                params.len()
            )));
        }
        let mut values = Vec::with_capacity(params.len());
        for (s, p) in self.shadow.iter().zip(params) {
            values.push(detached_copy(p.as_tensor(), &Device::Cpu)?);
            p.set(&s.to_dtype(p.dtype())?.to_device(p.device())?)?;
        }
        Ok(Stash { values })
    }
}

/// A copy of `t` on `device` that shares no storage with it (candle's `to_device` and `to_dtype`
/// return the same storage when nothing changes, and parameters are updated in place).
fn detached_copy(t: &Tensor, device: &Device) -> Result<Tensor> {
    if t.device().same_device(device) {
        Ok(t.copy()?)
    } else {
        Ok(t.to_device(device)?)
    }
}

impl Stash {
    /// Puts the model's own values back (bit-exact).
    pub fn restore(self, params: &[Var]) -> Result<()> {
        for (v, p) in self.values.into_iter().zip(params) {
            p.set(&v.to_device(p.device())?)?;
        }
        Ok(())
    }
}
