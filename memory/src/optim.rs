//! Optimizers on fp32 tensors, with the update rules of `torch.optim.AdamW` and `torch.optim.SGD`.
//!
//! They update the tensors they are given (the fp32 master weights when the model is stored in
//! bf16/f16, the model's own `Var`s otherwise) and count their state so the ledger can report it.

use candle_core::{DType, Tensor, Var};

use crate::error::{Error, Result};

/// An optimizer over a fixed list of parameters.
pub trait Optimizer: Send {
    /// One update of `params` with `grads` (same order; `None` leaves a parameter untouched, as
    /// PyTorch does for a parameter whose `.grad` is None) at learning rate `lr`, every gradient
    /// multiplied by `grad_mul` as it is read (a clipping factor, or 1 for none: the same bits as
    /// scaling fp32 copies first, without the copies). With `model`, `params` are fp32 masters
    /// and each updated one is then written into `model[i]`, the bf16/f16 weight the forward
    /// reads (on the model's device: the masters may live on the host), in the same pass where
    /// a kernel can. Only parameters with a gradient are updated and written.
    fn update(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
        model: Option<&[Var]>,
    ) -> Result<()>;
    /// Bytes of optimizer state held now.
    fn state_bytes(&self) -> u64;
    /// State tensors with stable names, for checkpoints (`exp_avg.3`, ...) and the step count.
    /// They share storage with the live state (no copy of gigabytes of moments to save them),
    /// which the fused CUDA step updates in place: write them out before the next step.
    fn state(&self) -> (u64, Vec<(String, Tensor)>);
    /// Restores what [`Optimizer::state`] returned.
    fn load_state(&mut self, step: u64, tensors: &[(String, Tensor)]) -> Result<()>;

    /// How this optimizer writes weights and which ones decay: what the two setters below
    /// change, kept in one [`WriteRules`] by every optimizer.
    fn rules(&mut self) -> &mut WriteRules;

    /// Write bf16 parameters with stochastic rounding from `seed` (a different stream per
    /// step and parameter, the same after a resume), or to nearest with `None`: for bf16
    /// weights trained without fp32 masters ([`crate::precision::Precision::full_bf16`]).
    fn set_stochastic_rounding(&mut self, seed: Option<u64>) {
        self.rules().sr = seed;
    }

    /// Parameters weight decay skips (`exempt[i]`), as HF Trainer skips biases and norm
    /// weights ([`hf_trainer_no_decay`]); by default every parameter decays.
    fn exempt_from_weight_decay(&mut self, exempt: Vec<bool>) {
        self.rules().exempt = exempt;
    }

    /// [`Optimizer::update`] without a gradient factor or model weights.
    fn step(&mut self, params: &[Var], grads: &[Option<Tensor>], lr: f64) -> Result<()> {
        self.update(params, grads, lr, 1.0, None)
    }

    /// [`Optimizer::update`] of fp32 masters `params`, written into `model`.
    fn step_into(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        model: &[Var],
    ) -> Result<()> {
        self.update(params, grads, lr, 1.0, Some(model))
    }
}

/// Whether HF Trainer's `get_decay_parameter_names` leaves a parameter out of weight decay: a
/// name containing "bias" (T5's `relative_attention_bias` included, as in transformers) or a
/// layer norm's (T5's `layer_norm`, `final_layer_norm`).
pub fn hf_trainer_no_decay(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.contains("bias") || n.contains("layer_norm") || n.contains("layernorm")
}

/// How an optimizer writes its updated weights and which ones decay, the same for every
/// optimizer: the stochastic-rounding seed of bf16 weights without masters (none: to nearest)
/// and the parameters weight decay skips (none unless told). Set through
/// [`Optimizer::set_stochastic_rounding`] and [`Optimizer::exempt_from_weight_decay`].
#[derive(Debug, Clone, Default)]
pub struct WriteRules {
    sr: Option<u64>,
    exempt: Vec<bool>,
}

impl WriteRules {
    /// The stochastic-rounding seed, if bf16 weights are rounded stochastically.
    pub(crate) fn sr(&self) -> Option<u64> {
        self.sr
    }

    /// The weight decay parameter `i` gets from the configured `wd`.
    pub(crate) fn wd(&self, i: usize, wd: f64) -> f64 {
        if self.exempt.get(i).copied().unwrap_or(false) {
            0.0
        } else {
            wd
        }
    }
}

/// Writes the updated fp32 values `w` into parameter `p` (index `i`) at step `t`: cast to its
/// dtype, or for a bf16 parameter with a stochastic-rounding seed rounded stochastically from a
/// stream of its own.
pub(crate) fn write_param(p: &Var, w: &Tensor, sr: Option<u64>, t: u64, i: usize) -> Result<()> {
    let w = match (p.dtype(), sr) {
        (DType::BF16, Some(seed)) => {
            ft_kernels::rounding::round_stochastic_bf16(w, rounding_seed(seed, t, i))?
        }
        (dt, _) => w.to_dtype(dt)?,
    };
    p.set(&w)?;
    Ok(())
}

/// The stochastic-rounding seed of parameter `i` at step `t` from the optimizer's `seed`: a
/// stream of its own per step and parameter (the element index is hashed in by the rounding),
/// the same on the CPU and in the fused CUDA update.
pub(crate) fn rounding_seed(seed: u64, t: u64, i: usize) -> u64 {
    let mut r = crate::rng::SplitMix64::new(seed ^ t.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let stream = r.next_u64() ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    // 0 means "to nearest" to the CUDA kernel.
    crate::rng::SplitMix64::new(stream).next_u64().max(1)
}

/// The seed a fused CUDA update rounds parameter `p` (index `i`, step `t`) with: a bf16 weight
/// without a master is rounded stochastically in the kernel from the stream [`write_param`]
/// would use on the CPU (`sr` the optimizer's seed); 0 (to nearest) for anything else.
#[cfg(feature = "cuda")]
pub(crate) fn kernel_seed(p: &Var, sr: Option<u64>, t: u64, i: usize) -> u64 {
    match (p.dtype(), sr) {
        (DType::BF16, Some(s)) => rounding_seed(s, t, i),
        _ => 0,
    }
}

/// Writes each updated master into the model weight it shadows: rounded to the weight's dtype
/// on the master's device first, so an offloaded step moves 2 bytes per bf16 weight, not 4.
/// Only parameters that got a gradient were updated, and only they are written.
pub(crate) fn write_back(params: &[Var], model: &[Var], grads: &[Option<Tensor>]) -> Result<()> {
    for ((m, p), g) in model.iter().zip(params).zip(grads) {
        if g.is_none() {
            continue;
        }
        let w = match crate::host::narrowed(p, m.dtype()) {
            Some(w) => w?,
            None => p.as_tensor().to_dtype(m.dtype())?,
        };
        m.set(&w.to_device(m.device())?)?;
    }
    Ok(())
}

/// A gradient as the update of `p` reads it: fp32, on `p`'s device (the host, when the
/// optimizer state is offloaded; a no-op move otherwise), detached from its graph.
fn grad_for(p: &Var, g: &Tensor) -> Result<Tensor> {
    Ok(g.to_device(p.device())?.to_dtype(DType::F32)?.detach())
}

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
}

/// The one error for an update given other lists than the optimizer was built for.
pub(crate) fn check_len(params: &[Var], grads: &[Option<Tensor>], state: usize) -> Result<()> {
    if params.len() != grads.len() || params.len() != state {
        return Err(Error::Invalid(format!(
            "optimizer built for {state} parameters got {} parameters and {} gradients",
            params.len(),
            grads.len()
        )));
    }
    Ok(())
}

fn state_tensors(prefix: &str, v: &[Option<Tensor>]) -> Vec<(String, Tensor)> {
    named_state(&[prefix], v, |t, _| t.as_ref())
}

/// Checkpoint entries `{kind}.{i}` of per-parameter state: for each of `kinds` in order, the
/// tensor `part(slot, k)` (the k-th kind) of every parameter that has one. They share storage
/// with the live state (see [`Optimizer::state`]).
pub(crate) fn named_state<S>(
    kinds: &[&str],
    slots: &[S],
    part: impl Fn(&S, usize) -> Option<&Tensor>,
) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    for (k, kind) in kinds.iter().enumerate() {
        for (i, s) in slots.iter().enumerate() {
            if let Some(t) = part(s, k) {
                out.push((format!("{kind}.{i}"), t.clone()));
            }
        }
    }
    out
}

/// A checkpoint entry's name `{kind}.{i}` split and checked against `n` parameters: `None` for
/// a name without an index (not per-parameter state).
pub(crate) fn state_name(name: &str, n: usize) -> Result<Option<(&str, usize)>> {
    let Some((kind, idx)) = name.rsplit_once('.') else {
        return Ok(None);
    };
    let i: usize = idx
        .parse()
        .map_err(|_| Error::Invalid(format!("optimizer state `{name}`: bad index")))?;
    if i >= n {
        return Err(Error::Invalid(format!(
            "optimizer state `{name}`: no parameter {i} of {n}"
        )));
    }
    Ok(Some((kind, i)))
}

fn load_slot(
    prefix: &str,
    slots: &mut [Option<Tensor>],
    tensors: &[(String, Tensor)],
) -> Result<()> {
    let n = slots.len();
    for (name, t) in tensors {
        if name
            .rsplit_once('.')
            .is_some_and(|(kind, _)| kind == prefix)
        {
            let Some((_, i)) = state_name(name, n)? else {
                continue;
            };
            let slot = &mut slots[i];
            if t.dtype() == DType::U8 {
                return Err(Error::Invalid(format!(
                    "optimizer state `{name}` holds 8-bit moments: resume with --optim adamw8bit"
                )));
            }
            // A copy of its own: the fused CUDA step updates moments in place, which must not
            // reach the caller's tensor (`to_dtype` to the same dtype shares its storage).
            *slot = Some(t.to_dtype(DType::F32)?.copy()?);
        }
    }
    Ok(())
}

impl AdamW {
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
            let seed = kernel_seed(p, self.rules.sr(), self.t, i);
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
}

/// Whether the fused CUDA kernels can update `p` from an fp32 master (or as an fp32 weight):
/// contiguous fp32 on CUDA.
#[cfg(feature = "cuda")]
fn fusable_master(p: &Var) -> bool {
    p.device().is_cuda() && p.dtype() == DType::F32 && p.as_tensor().is_contiguous()
}

/// Whether the fused CUDA kernels can update `p` in place without a master (`--full-bf16`):
/// contiguous bf16/f16 on CUDA.
#[cfg(feature = "cuda")]
fn fusable_in_place(p: &Var) -> bool {
    p.device().is_cuda()
        && matches!(p.dtype(), DType::BF16 | DType::F16)
        && p.as_tensor().is_contiguous()
}

/// Whether an update takes the fused CUDA kernels, and which model weights they write in the
/// same pass: `None` off the kernels (the kernels turned off, or a parameter given a gradient
/// that is not a contiguous CUDA tensor they take); `Some(Some(model))` where the kernels write
/// `model` too; `Some(None)` where there is no model or they cannot write it ([`finish`] then
/// does). Only the parameters given a gradient are looked at: a fused backward pass updates one
/// at a time, and looking at all 1,680 of the SDXL UNet's for each would be quadratic.
#[cfg(feature = "cuda")]
pub(crate) fn fused_path<'a>(
    params: &[Var],
    grads: &[Option<Tensor>],
    model: Option<&'a [Var]>,
) -> Option<Option<&'a [Var]>> {
    if !ft_kernels::cuda::enabled() {
        return None;
    }
    let stepped = || {
        params
            .iter()
            .zip(grads)
            .enumerate()
            .filter(|(_, (_, g))| g.is_some())
            .map(|(i, (p, _))| (i, p))
    };
    if stepped().all(|(_, p)| fusable_master(p)) {
        let writable = |m: &&[Var]| {
            m.len() == params.len() && stepped().all(|(i, _)| m[i].as_tensor().is_contiguous())
        };
        return Some(model.filter(writable));
    }
    (model.is_none() && stepped().all(|(_, p)| fusable_in_place(p))).then_some(None)
}

/// Writes the updated masters into the model weights, unless the update wrote them itself.
pub(crate) fn finish(
    params: &[Var],
    grads: &[Option<Tensor>],
    model: Option<&[Var]>,
    written: bool,
) -> Result<()> {
    match model {
        Some(m) if !written => write_back(params, m, grads),
        _ => Ok(()),
    }
}

/// The scalars of AdamW's step `t` at learning rate `lr`, gradients multiplied by `grad_mul`,
/// for the CUDA kernels (not yet the first step of any moments; round-to-nearest weights).
#[cfg(feature = "cuda")]
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

/// One parameter's fused CUDA step with fp32 moments `m`, `v`, which are updated in place (or
/// created, before the first step, or copied into a contiguous fp32 layout when restored in
/// another): `p` an fp32 master, with the model weight `w` written when given, or a bf16/f16
/// weight without a master, updated in place.
#[cfg(feature = "cuda")]
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

impl AdamW {
    /// The update off the fused kernels: one threaded pass per contiguous fp32 host
    /// parameter, the op-by-op reference otherwise (and everywhere with `op_by_op`).
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
        let host = crate::host_adamw::HostStep {
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
            // Detached throughout: optimizer state must not record (and keep alive) the graph
            // of the gradients it was computed from.
            let g = grad_for(p, g)?;
            self.place_moments(i, p.device())?;
            let wd = self.rules.wd(i, c.weight_decay);
            let host = crate::host_adamw::HostStep {
                weight_decay: wd,
                ..host
            };
            if self.host_fused {
                let (m, v) = (self.m[i].as_ref(), self.v[i].as_ref());
                if let Some((np, nm, nv)) = crate::host_adamw::update(p, &g, m, v, &host) {
                    let shape = p.shape();
                    p.set(&Tensor::from_vec(np, shape, p.device())?)?;
                    self.m[i] = Some(Tensor::from_vec(nm, shape, p.device())?);
                    self.v[i] = Some(Tensor::from_vec(nv, shape, p.device())?);
                    continue;
                }
            }
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
}

impl Optimizer for AdamW {
    /// The fused CUDA kernel for contiguous CUDA parameters, else the one-pass host update or
    /// the op-by-op one.
    fn update(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
        model: Option<&[Var]>,
    ) -> Result<()> {
        check_len(params, grads, self.m.len())?;
        #[cfg(feature = "cuda")]
        if let Some(into) = fused_path(params, grads, model) {
            self.step_fused(params, grads, lr, grad_mul, into)?;
            return finish(params, grads, model, into.is_some());
        }
        self.step_host(params, grads, lr, grad_mul)?;
        finish(params, grads, model, false)
    }

    fn rules(&mut self) -> &mut WriteRules {
        &mut self.rules
    }

    fn state_bytes(&self) -> u64 {
        self.m
            .iter()
            .chain(&self.v)
            .flatten()
            .map(crate::ledger::tensor_bytes)
            .sum()
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
    fn update(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
        model: Option<&[Var]>,
    ) -> Result<()> {
        check_len(params, grads, self.buf.len())?;
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
        match model {
            Some(m) => write_back(params, m, grads),
            None => Ok(()),
        }
    }

    fn rules(&mut self) -> &mut WriteRules {
        &mut self.rules
    }

    fn state_bytes(&self) -> u64 {
        self.buf
            .iter()
            .flatten()
            .map(crate::ledger::tensor_bytes)
            .sum()
    }

    fn state(&self) -> (u64, Vec<(String, Tensor)>) {
        (self.t, state_tensors("momentum_buffer", &self.buf))
    }

    fn load_state(&mut self, step: u64, tensors: &[(String, Tensor)]) -> Result<()> {
        self.t = step;
        load_slot("momentum_buffer", &mut self.buf, tensors)
    }
}
