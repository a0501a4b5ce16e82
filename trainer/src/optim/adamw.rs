//! AdamW with fp32 moments, as `torch.optim.AdamW` computes it.

use candle_core::{DType, Tensor, Var};

use super::rules::WriteRules;
use super::spec::OptimSpec;
use super::state::{load_slot, state_tensors};
use super::write::{grad_for, write_param};
use super::Optimizer;
use crate::error::Result;

/// `--optim adamw` (also `adamw_torch`).
pub const SPEC: OptimSpec = OptimSpec {
    names: &["adamw", "adamw_torch"],
    state_label: "AdamW moments (fp32)",
    state_bytes: |dims| 8 * dims.iter().product::<usize>() as u64,
    // The one-pass host update writes the weight and both moments in place, reading a bf16/f16
    // gradient as it is (its first step makes the moments, which the state row counts).
    step_bytes: |_| 0,
    in_place_on_gpu: true,
    build: |n, s| {
        Box::new(AdamW::new(
            n,
            AdamWConfig {
                weight_decay: s.weight_decay,
                ..AdamWConfig::default()
            },
        ))
    },
    gpu_needs_kernels: false,
};

/// AdamW hyper-parameters (PyTorch defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// AdamW exactly as `torch.optim.AdamW` (non-amsgrad, non-fused) computes it:
///
/// ```text
/// p   <- p * (1 - lr * wd)                       decoupled decay, before the moment update
/// m   <- b1 m + (1 - b1) g
/// v   <- b2 v + (1 - b2) g^2
/// p   <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
/// ```
///
/// Moments are fp32 whatever the parameter dtype (candle-nn's AdamW keeps them in the parameter
/// dtype, which loses small updates in bf16).
pub struct AdamW {
    cfg: AdamWConfig,
    t: u64,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    /// Contiguous fp32 CPU parameters take the one-pass threaded update (`host_adamw`); off,
    /// every parameter takes the op-by-op reference (the tests compare the two).
    host_fused: bool,
    /// Stochastic rounding and weight-decay exemptions ([`Optimizer::rules`]).
    rules: WriteRules,
}

impl AdamW {
    /// The reference update, op by op on every device (what `FT_HOST_ADAMW=0` selects on the
    /// CPU): the tests compare the one-pass host update with it.
    pub fn op_by_op(mut self) -> Self {
        self.host_fused = false;
        self
    }

    pub fn new(n_params: usize, cfg: AdamWConfig) -> Self {
        AdamW {
            cfg,
            t: 0,
            m: vec![None; n_params],
            v: vec![None; n_params],
            // FT_HOST_ADAMW=0 turns the one-pass host update off, like the CUDA switches.
            host_fused: std::env::var("FT_HOST_ADAMW").map_or(true, |v| v != "0"),
            rules: WriteRules::default(),
        }
    }

    /// Moves parameter `i`'s moments to `device` where they are elsewhere: state restored on
    /// one device (a checkpoint read beside the model) serves an optimizer on another (the host).
    fn place_moments(&mut self, i: usize, device: &candle_core::Device) -> Result<()> {
        for slot in [&mut self.m[i], &mut self.v[i]] {
            if let Some(t) = slot.as_ref() {
                if !t.device().same_device(device) {
                    *slot = Some(t.to_device(device)?);
                }
            }
        }
        Ok(())
    }
}

impl Optimizer for AdamW {
    fn n_params(&self) -> usize {
        self.m.len()
    }

    /// The one-pass threaded update for contiguous fp32 CPU parameters, the op-by-op one for
    /// the rest (and for every parameter with [`AdamW::op_by_op`]).
    fn step_host(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
    ) -> Result<()> {
        self.t += 1;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(self.t as i32);
        let bc2 = 1.0 - c.beta2.powi(self.t as i32);
        let step_size = lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        let host = super::host_adamw::HostStep {
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            lr,
            weight_decay: c.weight_decay,
            step_size,
            bc2_sqrt,
            grad_mul,
        };
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            self.place_moments(i, p.device())?;
            let wd = self.rules.wd(i, c.weight_decay);
            let host = super::host_adamw::HostStep {
                weight_decay: wd,
                ..host
            };
            if self.host_fused {
                use super::host_adamw::{first_update, update_in_place};
                // The gradient in its own dtype (the pass widens bf16/f16 per element: no f32
                // copy), detached: optimizer state must not keep the graph it came from.
                let g = g.to_device(p.device())?.detach();
                let done = match (&self.m[i], &self.v[i]) {
                    (Some(m), Some(v)) => update_in_place(p, &g, m, v, &host)?,
                    (None, None) => match first_update(p, &g, &host)? {
                        Some((nm, nv)) => {
                            self.m[i] = Some(Tensor::from_vec(nm, p.shape(), p.device())?);
                            self.v[i] = Some(Tensor::from_vec(nv, p.shape(), p.device())?);
                            true
                        }
                        None => false,
                    },
                    _ => false,
                };
                if done {
                    continue;
                }
            }
            // Detached throughout, as above.
            let g = grad_for(p, g)?;
            let g = if grad_mul != 1.0 { (g * grad_mul)? } else { g };
            let m = match &self.m[i] {
                Some(m) => ((m * c.beta1)? + (&g * (1.0 - c.beta1))?)?,
                None => (&g * (1.0 - c.beta1))?,
            };
            let g2 = g.sqr()?;
            let v = match &self.v[i] {
                Some(v) => ((v * c.beta2)? + (g2 * (1.0 - c.beta2))?)?,
                None => (g2 * (1.0 - c.beta2))?,
            };
            let denom = ((v.sqrt()? / bc2_sqrt)? + c.eps)?;
            let p32 = p.as_tensor().to_dtype(DType::F32)?.detach();
            let decayed = if wd != 0.0 {
                (p32 * (1.0 - lr * wd))?
            } else {
                p32
            };
            let update = ((&m / denom)? * step_size)?;
            write_param(p, &(decayed - update)?, self.rules.sr(), self.t, i)?;
            self.m[i] = Some(m.detach());
            self.v[i] = Some(v.detach());
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn has_kernels(&self) -> bool {
        true
    }

    /// The whole update in one kernel per parameter (`ft_kernels::cuda::adamw_fused`): reads
    /// the master, both moments and the gradient once, writes them and the model weight once,
    /// where the op-by-op update makes about fifteen passes over fp32 tensors.
    #[cfg(feature = "cuda")]
    fn step_fused(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
        model: Option<&[Var]>,
    ) -> Result<()> {
        self.t += 1;
        let base = cuda_step(&self.cfg, self.t, lr, grad_mul);
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            self.place_moments(i, p.device())?;
            let w = model.map(|ms| ms[i].as_tensor());
            let seed = super::write::kernel_seed(p, self.rules.sr(), self.t, i);
            let weight_decay = self.rules.wd(i, self.cfg.weight_decay);
            let step = ft_kernels::cuda::AdamWStep {
                seed,
                weight_decay,
                ..base
            };
            fused_fp32_moments(p, g, &mut self.m[i], &mut self.v[i], w, &step)?;
        }
        Ok(())
    }

    fn rules(&mut self) -> &mut WriteRules {
        &mut self.rules
    }

    fn state(&self) -> (u64, Vec<(String, Tensor)>) {
        let mut v = state_tensors("exp_avg", &self.m);
        v.extend(state_tensors("exp_avg_sq", &self.v));
        (self.t, v)
    }

    fn load_state(&mut self, step: u64, tensors: &[(String, Tensor)]) -> Result<()> {
        self.t = step;
        load_slot("exp_avg", &mut self.m, tensors)?;
        load_slot("exp_avg_sq", &mut self.v, tensors)
    }
}

#[cfg(feature = "cuda")]
/// The scalars of AdamW's step `t` at learning rate `lr`, gradients multiplied by `grad_mul`,
/// for the CUDA kernels (not yet the first step of any moments; round-to-nearest weights).
pub(crate) fn cuda_step(
    c: &AdamWConfig,
    t: u64,
    lr: f64,
    grad_mul: f64,
) -> ft_kernels::cuda::AdamWStep {
    ft_kernels::cuda::AdamWStep {
        lr,
        beta1: c.beta1,
        beta2: c.beta2,
        eps: c.eps,
        weight_decay: c.weight_decay,
        step_size: lr / (1.0 - c.beta1.powi(t as i32)),
        bc2_sqrt: (1.0 - c.beta2.powi(t as i32)).sqrt(),
        grad_mul,
        first: false,
        seed: 0,
    }
}

#[cfg(feature = "cuda")]
/// One parameter's fused CUDA step with fp32 moments `m`, `v`, which are updated in place (or
/// created, before the first step, or copied into a contiguous fp32 layout when restored in
/// another): `p` an fp32 master, with the model weight `w` written when given, or a bf16/f16
/// weight without a master, updated in place.
pub(crate) fn fused_fp32_moments(
    p: &Var,
    g: &Tensor,
    m: &mut Option<Tensor>,
    v: &mut Option<Tensor>,
    w: Option<&Tensor>,
    base: &ft_kernels::cuda::AdamWStep,
) -> Result<()> {
    let g = g.detach().contiguous()?;
    let first = m.is_none() && v.is_none();
    let ok = |t: &Tensor| t.is_contiguous() && t.dtype() == DType::F32;
    let like = |t: &Option<Tensor>| -> Result<Tensor> {
        Ok(match t {
            Some(t) => t.to_dtype(DType::F32)?.contiguous()?.copy()?,
            None => Tensor::zeros(p.shape(), DType::F32, p.device())?,
        })
    };
    let (nm, nv) = match (&*m, &*v) {
        (Some(m), Some(v)) if ok(m) && ok(v) => (m.clone(), v.clone()),
        (m, v) => (like(m)?, like(v)?),
    };
    let step = ft_kernels::cuda::AdamWStep { first, ..*base };
    if p.dtype() == DType::F32 {
        ft_kernels::cuda::adamw_fused(p.as_tensor(), &nm, &nv, &g, w, &step)?;
    } else {
        ft_kernels::cuda::adamw_fused_in_place(p.as_tensor(), &nm, &nv, &g, &step)?;
    }
    *m = Some(nm);
    *v = Some(nv);
    Ok(())
}
