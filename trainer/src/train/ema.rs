//! An exponential moving average of the trained weights that does not double device memory.
//!
//! The average is kept in fp32 on the host by default (seed 003: an EMA copy on the GPU is a whole
//! second model). It is updated every `every` optimizer steps from the fp32 master weights (or the
//! weights themselves when they are fp32), one tensor at a time, so the device only ever holds one
//! parameter's worth of transfer. Evaluation swaps the averaged values into the model's own
//! parameters and back ([`Ema::swap_in`]), so no second model exists on the device then either.
//!
//! Over the ranks of a data-parallel run the average is sharded ([`Ema::sharded`]): each rank
//! averages the tensors ZeRO's partition gives it (under ZeRO, those whose fp32 masters it
//! keeps), so no rank holds more than its share, about a world-th of the model in fp32.
//! Rank 0, which evaluates and saves, takes the other ranks' shares one tensor at a time as it
//! writes them into its model or its checkpoint ([`crate::update::gather`]); the other ranks
//! send them meanwhile ([`Ema::serve_evaluation`], [`Ema::send`]).

use std::collections::HashMap;
use std::rc::Rc;

use candle_core::{DType, Device, Tensor, Var};
use ft_dist::Comm;

use crate::error::{Error, Result};
use crate::update::gather::gather;

/// The moving average of a list of parameters (this rank's share of it).
pub struct Ema {
    names: Vec<String>,
    /// The average of the tensors this rank keeps; `None` where another rank keeps it.
    shadow: Vec<Option<Tensor>>,
    decay: f64,
    every: u64,
    device: Device,
    comm: Rc<Comm>,
}

/// The model's own values while the average is swapped in; [`Stash::restore`] puts them back.
pub struct Stash {
    values: Vec<(usize, Tensor)>,
}

impl Ema {
    /// Starts the average at the current values of `params` (fp32 copies on `device`), whole,
    /// in one process.
    pub fn new(
        names: &[String],
        params: &[Var],
        decay: f64,
        every: u64,
        device: &Device,
    ) -> Result<Self> {
        let sizes: Vec<usize> = params.iter().map(|p| p.elem_count()).collect();
        let solo = Rc::new(Comm::solo());
        Self::sharded(names, params, &sizes, decay, every, device, solo)
    }

    /// This rank's share of the average over the ranks of `comm`: the tensors
    /// [`crate::update::zero::partition`] gives this rank for parameters of `sizes` values
    /// (the model's, as ZeRO partitions them); `params` are read for those alone (under ZeRO
    /// the other ranks' masters are empty here).
    pub fn sharded(
        names: &[String],
        params: &[Var],
        sizes: &[usize],
        decay: f64,
        every: u64,
        device: &Device,
        comm: Rc<Comm>,
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
        if names.len() != params.len() || sizes.len() != params.len() {
            return Err(Error::Invalid(format!(
                "EMA: {} names and {} sizes for {} parameters",
                names.len(),
                sizes.len(),
                params.len()
            )));
        }
        let owner = crate::update::zero::partition(sizes, comm.world());
        let shadow = params
            .iter()
            .zip(owner)
            .map(|(p, r)| {
                (r == comm.rank())
                    .then(|| Ok(detached_copy(p.as_tensor(), device)?.to_dtype(DType::F32)?))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Ema {
            names: names.to_vec(),
            shadow,
            decay,
            every,
            device: device.clone(),
            comm,
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
        let mine = self.shadow.iter_mut().zip(params);
        for (s, p) in mine.filter_map(|(s, p)| s.as_mut().map(|s| (s, p))) {
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

    /// Bytes this rank's share of the average holds (fp32).
    pub fn bytes(&self) -> u64 {
        self.shadow
            .iter()
            .flatten()
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// This rank's averaged tensors with their parameter names.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        self.names
            .iter()
            .zip(&self.shadow)
            .filter_map(|(n, s)| s.clone().map(|s| (n.clone(), s)))
            .collect()
    }

    /// Replaces this rank's share of the average with saved tensors (resume); every name it
    /// keeps must be present.
    pub fn load(&mut self, get: impl Fn(&str, &[usize]) -> Result<Tensor>) -> Result<()> {
        for (name, s) in self.names.iter().zip(self.shadow.iter_mut()) {
            if let Some(s) = s {
                let t = get(name, s.dims())?;
                *s = t.to_dtype(DType::F32)?.to_device(&self.device)?;
            }
        }
        Ok(())
    }

    /// Writes the average into `params` (cast to their dtype and device), returning the values it
    /// replaced, kept on the host. One parameter is in flight on the device at a time. Over
    /// several ranks this is rank 0's, the others meanwhile in [`Ema::serve_evaluation`].
    pub fn swap_in(&self, params: &[Var]) -> Result<Stash> {
        if params.len() != self.shadow.len() {
            return Err(Error::Invalid(format!(
                "EMA holds {} tensors, the model has {}",
                self.shadow.len(),
                params.len()
            )));
        }
        self.tell(true)?;
        let index: HashMap<&str, usize> = self
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let mut shares = self.gathered()?;
        let mut values = Vec::with_capacity(params.len());
        while let Some((name, s)) = shares.next()? {
            let i = *index.get(name.as_str()).ok_or_else(|| {
                Error::Invalid(format!("EMA: a rank sent `{name}`, which is no parameter"))
            })?;
            let p = &params[i];
            values.push((i, detached_copy(p.as_tensor(), &Device::Cpu)?));
            p.set(&s.to_dtype(p.dtype())?.to_device(p.device())?)?;
        }
        Ok(Stash { values })
    }

    /// Rank 0's evaluation without the average: tells the other ranks (in
    /// [`Ema::serve_evaluation`]) that it needs nothing of them this time.
    pub fn decline(&self) -> Result<()> {
        self.tell(false)
    }

    /// On every rank but 0 while rank 0 evaluates: sends this rank's share if rank 0 swaps
    /// the average in ([`Ema::swap_in`]), else nothing ([`Ema::decline`]).
    pub fn serve_evaluation(&self) -> Result<()> {
        let mut swap = [0u8];
        self.comm.broadcast(&mut swap, 0)?;
        if swap[0] == 1 {
            self.send()?;
        }
        Ok(())
    }

    /// Writes the whole average into one safetensors file at `path` (rank 0; the other ranks
    /// send their shares meanwhile, [`Ema::send`]), one tensor at a time.
    pub fn write(&self, path: &std::path::Path) -> Result<()> {
        self.gathered()?.write(path)?;
        Ok(())
    }

    /// On every rank but 0: sends this rank's share to rank 0, which is in [`Ema::write`] or
    /// [`Ema::swap_in`].
    pub fn send(&self) -> Result<()> {
        gather(&self.comm, self.tensors())?;
        Ok(())
    }

    /// Rank 0's side of a gather of every rank's share.
    fn gathered(&self) -> Result<crate::update::gather::Gathered<'_>> {
        gather(&self.comm, self.tensors())?
            .ok_or_else(|| Error::Invalid("the whole EMA is taken by rank 0 alone".into()))
    }

    /// Rank 0 tells the other ranks whether it takes their shares for an evaluation.
    fn tell(&self, swap: bool) -> Result<()> {
        if self.comm.world() > 1 {
            self.comm.broadcast(&mut [swap as u8], 0)?;
        }
        Ok(())
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
        for (i, v) in self.values {
            let p = params.get(i).ok_or_else(|| {
                Error::Invalid(format!(
                    "EMA: parameter {i} to restore, the model has fewer"
                ))
            })?;
            p.set(&v.to_device(p.device())?)?;
        }
        Ok(())
    }
}
