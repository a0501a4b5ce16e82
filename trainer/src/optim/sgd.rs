//! SGD with momentum, as `torch.optim.SGD` computes it.

use candle_core::{DType, Tensor, Var};

use super::rules::WriteRules;
use super::spec::OptimSpec;
use super::state::{load_slot, state_tensors};
use super::write::{grad_for, write_param};
use super::Optimizer;
use crate::error::Result;

/// `--optim sgd`: `torch.optim.SGD`'s defaults (no momentum, so no state) with `--weight-decay`
/// added to the gradient, as torch's SGD applies it.
pub const SPEC: OptimSpec = OptimSpec {
    names: &["sgd"],
    state_label: "SGD (no state without momentum)",
    state_bytes: |_| 0,
    // The scaled gradient and the new weights.
    step_bytes: |dims| 8 * dims.iter().product::<usize>() as u64,
    in_place_on_gpu: false,
    build: |n, s| Box::new(Sgd::new(n, 0.0, s.weight_decay, false)),
    gpu_needs_kernels: false,
};

/// SGD as `torch.optim.SGD` (dampening 0): `g += wd p; b = mu b + g (b = g at first); p -= lr b`,
/// or `p -= lr (g + mu b)` with Nesterov.
pub struct Sgd {
    momentum: f64,
    weight_decay: f64,
    nesterov: bool,
    t: u64,
    buf: Vec<Option<Tensor>>,
    /// Stochastic rounding and weight-decay exemptions ([`Optimizer::rules`]).
    rules: WriteRules,
}

impl Sgd {
    pub fn new(n_params: usize, momentum: f64, weight_decay: f64, nesterov: bool) -> Self {
        Sgd {
            momentum,
            weight_decay,
            nesterov,
            t: 0,
            buf: vec![None; n_params],
            rules: WriteRules::default(),
        }
    }
}

impl Optimizer for Sgd {
    fn n_params(&self) -> usize {
        self.buf.len()
    }

    fn step_host(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
    ) -> Result<()> {
        self.t += 1;
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let mut g = grad_for(p, g)?;
            if grad_mul != 1.0 {
                g = (g * grad_mul)?;
            }
            let p32 = p.as_tensor().to_dtype(DType::F32)?.detach();
            let wd = self.rules.wd(i, self.weight_decay);
            if wd != 0.0 {
                g = (g + (&p32 * wd)?)?;
            }
            if self.momentum != 0.0 {
                let b = match &self.buf[i] {
                    Some(b) => ((b * self.momentum)? + &g)?,
                    None => g.clone(),
                };
                g = if self.nesterov {
                    (g + (&b * self.momentum)?)?
                } else {
                    b.clone()
                };
                self.buf[i] = Some(b.detach());
            }
            write_param(p, &(p32 - (g * lr)?)?, self.rules.sr(), self.t, i)?;
        }
        Ok(())
    }

    fn rules(&mut self) -> &mut WriteRules {
        &mut self.rules
    }

    fn state(&self) -> (u64, Vec<(String, Tensor)>) {
        (self.t, state_tensors("momentum_buffer", &self.buf))
    }

    fn load_state(&mut self, step: u64, tensors: &[(String, Tensor)]) -> Result<()> {
        self.t = step;
        load_slot("momentum_buffer", &mut self.buf, tensors)
    }
}
