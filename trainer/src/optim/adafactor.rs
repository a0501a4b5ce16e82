//! Adafactor (Shazeer & Stern, 2018) as `transformers.optimization.Adafactor` computes it.
//!
//! The second moment of a matrix (and of any tensor of two or more dimensions, over its last
//! two) is kept factored: one fp32 value per row and one per column (FLAN-T5-XL: 9.7 MiB instead
//! of AdamW's 21 GiB; the SDXL UNet: 0.9 GiB instead of 19 GiB, as a convolution's kernel
//! dimensions are the two that get factored, which for 3x3 and 1x1 kernels saves little or
//! costs more, as in transformers), and there is no first moment
//! unless `beta1` asks for one. This is the optimizer kohya's sd-scripts recommends for full
//! SDXL fine-tunes, and what HF Trainer's `--optim adafactor` builds
//! ([`AdafactorConfig::trainer`]: the schedule's learning rate, no relative step, no parameter
//! scale). Per step, with `g` the gradient and `t` the step:
//!
//! ```text
//! beta2t = 1 - t^decay_rate
//! row    <- beta2t row + (1 - beta2t) mean_cols(g^2 + eps1)      (factored)
//! col    <- beta2t col + (1 - beta2t) mean_rows(g^2 + eps1)
//! u      = g / sqrt(row / mean(row) (x) col)                      (v <- ... ; u = g / sqrt(v) unfactored)
//! u      <- u / max(1, rms(u) / clip_threshold) * lr
//! m      <- beta1 m + (1 - beta1) u ; u = m                        (with beta1)
//! p      <- p - wd lr p - u
//! ```
//!
//! `lr` is the schedule's, or with `relative_step` `min(1e-2, 1/sqrt(t))` (times
//! `max(eps2, rms(p))` with `scale_parameter`). On a GPU, HF Trainer's configuration (no
//! `beta1`, no parameter scale) runs as five or six fused kernel launches per tensor
//! (`ft_kernels::cuda::adafactor_fused`); everything else runs as tensor ops on the parameter's
//! device. Neither reads a scalar back. The step count is one for the optimizer,
//! as in this crate's AdamW (transformers counts per parameter; they differ only for a
//! parameter that went without a gradient for a step).

use candle_core::{DType, Device, Tensor, Var};

use super::rules::WriteRules;
use super::spec::OptimSpec;
use super::Optimizer;
use crate::error::{Error, Result};

/// `--optim adafactor`: HF Trainer's settings ([`AdafactorConfig::trainer`]).
pub const SPEC: OptimSpec = OptimSpec {
    names: &["adafactor"],
    state_label: "Adafactor second moments (fp32, factored over the last two dims)",
    state_bytes: |dims| state_bytes_for(dims, false),
    // Candle ops: five tensors of the parameter's size alive at once at most (measured), one
    // fewer unfactored.
    step_bytes: |dims| {
        let n = dims.iter().product::<usize>() as u64;
        match factored_shapes(dims) {
            Some(_) => 20 * n,
            None => 16 * n,
        }
    },
    in_place_on_gpu: true,
    build: |n, s| Box::new(Adafactor::new(n, AdafactorConfig::trainer(s.weight_decay))),
    gpu_needs_kernels: false,
};

/// Adafactor's hyper-parameters (`transformers.optimization.Adafactor`'s names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdafactorConfig {
    /// Added to the squared gradient (`eps[0]`).
    pub eps1: f64,
    /// Lower bound of the parameter scale (`eps[1]`).
    pub eps2: f64,
    /// Bound on the update's RMS before the learning rate.
    pub clip_threshold: f64,
    /// Exponent of the second moment's decay: `beta2t = 1 - t^decay_rate`.
    pub decay_rate: f64,
    /// First-moment coefficient; `None` keeps no first moment.
    pub beta1: Option<f64>,
    pub weight_decay: f64,
    /// Multiply the step size by the parameter's RMS (at least `eps2`).
    pub scale_parameter: bool,
    /// Ignore the learning rate given and use `min(1e-2, 1/sqrt(t))`.
    pub relative_step: bool,
    /// With `relative_step`: `min(1e-6 t, 1/sqrt(t))` instead.
    pub warmup_init: bool,
}

impl AdafactorConfig {
    /// The paper's setting (transformers' defaults): relative step, parameter scale.
    pub fn paper() -> Self {
        AdafactorConfig {
            eps1: 1e-30,
            eps2: 1e-3,
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            weight_decay: 0.0,
            scale_parameter: true,
            relative_step: true,
            warmup_init: false,
        }
    }

    /// What HF Trainer's `--optim adafactor` builds (and kohya's recommended SDXL arguments
    /// `scale_parameter=False relative_step=False warmup_init=False`): the schedule's learning
    /// rate as it is.
    pub fn trainer(weight_decay: f64) -> Self {
        AdafactorConfig {
            weight_decay,
            scale_parameter: false,
            relative_step: false,
            ..Self::paper()
        }
    }
}

/// One parameter's state: factored second moment (row, col) or a full one, and the optional
/// first moment.
#[derive(Default, Clone)]
struct Slot {
    row: Option<Tensor>,
    col: Option<Tensor>,
    full: Option<Tensor>,
    m: Option<Tensor>,
}

/// Adafactor over a fixed list of parameters.
pub struct Adafactor {
    cfg: AdafactorConfig,
    t: u64,
    slots: Vec<Slot>,
    /// Stochastic rounding and weight-decay exemptions (`Optimizer::rules`).
    rules: WriteRules,
}

/// The shapes of a tensor's factored second moment: its dims without the last, and without the
/// second-to-last (transformers' `exp_avg_sq_row`, `exp_avg_sq_col`); `None` below two dims.
pub fn factored_shapes(dims: &[usize]) -> Option<(Vec<usize>, Vec<usize>)> {
    let r = dims.len();
    if r < 2 {
        return None;
    }
    let row = dims[..r - 1].to_vec();
    let mut col = dims[..r - 2].to_vec();
    col.push(dims[r - 1]);
    Some((row, col))
}

/// Bytes of Adafactor state for a tensor of shape `dims` (fp32; `beta1` adds a full moment).
pub fn state_bytes_for(dims: &[usize], beta1: bool) -> u64 {
    let n: usize = dims.iter().product();
    let second = match factored_shapes(dims) {
        Some((r, c)) => r.iter().product::<usize>() + c.iter().product::<usize>(),
        None => n,
    };
    4 * (second + if beta1 { n } else { 0 }) as u64
}

impl Adafactor {
    pub fn new(n_params: usize, cfg: AdafactorConfig) -> Self {
        Adafactor {
            cfg,
            t: 0,
            slots: vec![Slot::default(); n_params],
            rules: WriteRules::default(),
        }
    }

    /// The learning rate of this step before any parameter scale: the schedule's, or with
    /// `relative_step` transformers' relative step.
    fn base_lr(&self, lr: f64) -> f64 {
        let c = &self.cfg;
        let t = self.t as f64;
        if c.relative_step {
            let min_step = if c.warmup_init { 1e-6 * t } else { 1e-2 };
            min_step.min(1.0 / t.sqrt())
        } else {
            lr
        }
    }

    /// The step size of this step for a parameter whose fp32 values are `p` (transformers'
    /// `_get_lr`), as a one-element tensor on `p`'s device when it depends on `p`.
    fn step_size(&self, p: &Tensor, lr: f64) -> Result<Tensor> {
        let one = Tensor::new(&[self.base_lr(lr) as f32], p.device())?;
        if !self.cfg.scale_parameter {
            return Ok(one);
        }
        Ok(rms(p)?.maximum(self.cfg.eps2)?.broadcast_mul(&one)?)
    }

    /// Parameter `i`'s gradient checked against its weights' shape `dims`, and its restored
    /// state against the shapes Adafactor keeps for them: the factored shapes, or `None` for a
    /// full second moment.
    fn checked_shapes(
        &self,
        i: usize,
        dims: &[usize],
        g: &Tensor,
    ) -> Result<Option<(Vec<usize>, Vec<usize>)>> {
        if g.dims() != dims {
            return Err(Error::Invalid(format!(
                "parameter {i}: gradient of shape {:?} for weights of shape {dims:?}",
                g.dims()
            )));
        }
        let slot = &self.slots[i];
        let shapes = factored_shapes(dims);
        match &shapes {
            Some((row_dims, col_dims)) => {
                if slot.full.is_some() {
                    return Err(Error::Invalid(format!(
                        "optimizer state `exp_avg_sq.{i}`: a full second moment for parameter \
                         {i} of shape {dims:?}, which Adafactor factors (a checkpoint of another \
                         optimizer?)"
                    )));
                }
                check(i, "exp_avg_sq_row", &slot.row, row_dims)?;
                check(i, "exp_avg_sq_col", &slot.col, col_dims)?;
            }
            None => check(i, "exp_avg_sq", &slot.full, dims)?,
        }
        if self.cfg.beta1.is_some() {
            check(i, "exp_avg", &slot.m, dims)?;
        }
        Ok(shapes)
    }

    /// Whether the fused CUDA kernels compute this configuration's update: no first moment, no
    /// parameter scale (HF Trainer's `--optim adafactor` and kohya's SDXL arguments).
    #[cfg(feature = "cuda")]
    fn kernel_computes(&self) -> bool {
        self.cfg.beta1.is_none() && !self.cfg.scale_parameter
    }
}

/// A second-moment tensor the CUDA kernels can update in place: the state as it is when it is
/// contiguous fp32 on `device`, a contiguous fp32 copy there when restored elsewhere, zeros
/// before the first step (`beta2t x + ...` of zero is the host's first value exactly).
#[cfg(feature = "cuda")]
fn fp32_state(t: &Option<Tensor>, dims: &[usize], device: &Device) -> Result<Tensor> {
    Ok(match t {
        Some(t)
            if t.is_contiguous() && t.dtype() == DType::F32 && t.device().same_device(device) =>
        {
            t.clone()
        }
        Some(t) => t
            .to_device(device)?
            .to_dtype(DType::F32)?
            .contiguous()?
            .copy()?,
        None => Tensor::zeros(dims, DType::F32, device)?,
    })
}

/// `norm(x) / sqrt(numel)` as a one-element tensor.
fn rms(x: &Tensor) -> Result<Tensor> {
    let n = x.elem_count().max(1) as f64;
    Ok((x.sqr()?.sum_all()?.sqrt()? / n.sqrt())?.reshape(1)?)
}

/// `t` on `device`, moved there when it is elsewhere (state restored on the host).
fn placed(t: &Option<Tensor>, device: &Device) -> Result<Option<Tensor>> {
    Ok(match t {
        Some(t) if !t.device().same_device(device) => Some(t.to_device(device)?),
        t => t.clone(),
    })
}

/// A restored state tensor checked against the shape this parameter needs.
fn check(i: usize, name: &str, t: &Option<Tensor>, dims: &[usize]) -> Result<()> {
    match t {
        Some(t) if t.dims() != dims => Err(Error::Invalid(format!(
            "optimizer state `{name}.{i}`: shape {:?}, parameter {i} needs {dims:?} (a \
             checkpoint of another model or optimizer?)",
            t.dims()
        ))),
        _ => Ok(()),
    }
}

impl Optimizer for Adafactor {
    fn n_params(&self) -> usize {
        self.slots.len()
    }

    /// The update as candle ops on each parameter's device (any configuration, any device).
    fn step_host(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
    ) -> Result<()> {
        self.t += 1;
        let c = self.cfg;
        let beta2t = 1.0 - (self.t as f64).powf(c.decay_rate);
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let dev = p.device();
            let g = g.to_device(dev)?.to_dtype(DType::F32)?.detach();
            let g = if grad_mul != 1.0 { (g * grad_mul)? } else { g };
            let dims = p.dims().to_vec();
            let shapes = self.checked_shapes(i, &dims, &g)?;
            let w = p.as_tensor().to_dtype(DType::F32)?.detach();
            let lr_t = self.step_size(&w, lr)?;
            let slot = &mut self.slots[i];
            let decay = |x: &Option<Tensor>, fresh: Tensor| -> Result<Tensor> {
                let fresh = (fresh * (1.0 - beta2t))?;
                Ok(match x {
                    Some(x) => ((x * beta2t)? + fresh)?,
                    None => fresh,
                })
            };
            let sq = (g.sqr()? + c.eps1)?;
            let update = match shapes {
                Some(_) => {
                    let r = dims.len() - 1;
                    let row = decay(&placed(&slot.row, dev)?, sq.mean(r)?)?;
                    let col = decay(&placed(&slot.col, dev)?, sq.mean(r - 1)?)?;
                    let r_factor = row
                        .broadcast_div(&row.mean_keepdim(r - 1)?)?
                        .sqrt()?
                        .recip()?
                        .unsqueeze(r)?;
                    let c_factor = col.unsqueeze(r - 1)?.sqrt()?.recip()?;
                    let u = r_factor.broadcast_mul(&c_factor)?.mul(&g)?;
                    slot.row = Some(row.detach());
                    slot.col = Some(col.detach());
                    u
                }
                None => {
                    let v = decay(&placed(&slot.full, dev)?, sq)?;
                    let u = v.sqrt()?.recip()?.mul(&g)?;
                    slot.full = Some(v.detach());
                    u
                }
            };
            // u / max(1, rms(u) / clip), then the step size: all on the device.
            let denom = (rms(&update)? / c.clip_threshold)?.maximum(1.0)?;
            let mut update = update.broadcast_div(&denom)?.broadcast_mul(&lr_t)?;
            if let Some(b1) = c.beta1 {
                let fresh = (&update * (1.0 - b1))?;
                let m = match placed(&slot.m, dev)? {
                    Some(m) => ((m * b1)? + fresh)?,
                    None => fresh,
                };
                slot.m = Some(m.detach());
                update = m;
            }
            let wd = self.rules.wd(i, c.weight_decay);
            let w = if wd != 0.0 {
                let wd = lr_t.affine(-wd, 0.0)?;
                (&w + w.broadcast_mul(&wd)?)?
            } else {
                w
            };
            super::write::write_param(p, &(w - update)?, self.rules.sr(), self.t, i)?;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn has_kernels(&self) -> bool {
        self.kernel_computes()
    }

    /// The whole update of each parameter in five or six CUDA kernel launches
    /// (`ft_kernels::cuda::adafactor_fused`), the second moment updated in place and the model
    /// weight written in the same pass, where the op-by-op update makes about 35 candle ops.
    /// Agrees with [`Self::host`] to rounding (its sums add in another order).
    #[cfg(feature = "cuda")]
    fn step_fused(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
        model: Option<&[Var]>,
    ) -> Result<()> {
        use ft_kernels::cuda::{adafactor_fused, adafactor_fused_in_place, SecondMoment};
        self.t += 1;
        let c = self.cfg;
        let base = ft_kernels::cuda::AdafactorStep {
            lr: self.base_lr(lr),
            eps1: c.eps1,
            beta2t: 1.0 - (self.t as f64).powf(c.decay_rate),
            clip_threshold: c.clip_threshold,
            weight_decay: c.weight_decay,
            grad_mul,
            seed: 0,
        };
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let g = g.detach().contiguous()?;
            let shapes = self.checked_shapes(i, p.dims(), &g)?;
            let step = ft_kernels::cuda::AdafactorStep {
                seed: super::write::kernel_seed(p, self.rules.sr(), self.t, i),
                weight_decay: self.rules.wd(i, c.weight_decay),
                ..base
            };
            let dev = p.device();
            let slot = &mut self.slots[i];
            let (row, col) = match &shapes {
                Some((row_dims, col_dims)) => (
                    fp32_state(&slot.row, row_dims, dev)?,
                    Some(fp32_state(&slot.col, col_dims, dev)?),
                ),
                None => (fp32_state(&slot.full, p.dims(), dev)?, None),
            };
            let v = match &col {
                Some(col) => SecondMoment::Factored { row: &row, col },
                None => SecondMoment::Full(&row),
            };
            if p.dtype() == DType::F32 {
                let w = model.map(|ms| ms[i].as_tensor());
                adafactor_fused(p.as_tensor(), &v, &g, w, &step)?;
            } else {
                adafactor_fused_in_place(p.as_tensor(), &v, &g, &step)?;
            }
            match col {
                Some(col) => {
                    slot.row = Some(row);
                    slot.col = Some(col);
                }
                None => slot.full = Some(row),
            }
        }
        Ok(())
    }

    fn rules(&mut self) -> &mut WriteRules {
        &mut self.rules
    }

    fn state(&self) -> (u64, Vec<(String, Tensor)>) {
        let kinds = ["exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"];
        let out = super::state::named_state(&kinds, &self.slots, |s, k| {
            [&s.row, &s.col, &s.full, &s.m][k].as_ref()
        });
        (self.t, out)
    }

    fn load_state(&mut self, step: u64, tensors: &[(String, Tensor)]) -> Result<()> {
        self.t = step;
        let n = self.slots.len();
        for (name, t) in tensors {
            let Some((kind, i)) = super::state::state_name(name, n)? else {
                continue;
            };
            let slot = &mut self.slots[i];
            let part = match kind {
                "exp_avg_sq_row" => &mut slot.row,
                "exp_avg_sq_col" => &mut slot.col,
                "exp_avg_sq" => &mut slot.full,
                "exp_avg" => &mut slot.m,
                _ => continue,
            };
            if t.dtype() != DType::F32 {
                return Err(Error::Invalid(format!(
                    "optimizer state `{name}`: {:?}, Adafactor keeps fp32 (a checkpoint of \
                     another optimizer?)",
                    t.dtype()
                )));
            }
            // AdamW's checkpoints use the same names: its first moment, which Adafactor without
            // beta1 never keeps, gives it away before gigabytes of it are carried along.
            if kind == "exp_avg" && self.cfg.beta1.is_none() {
                return Err(Error::Invalid(format!(
                    "optimizer state `{name}`: a first moment, which this Adafactor (no beta1) \
                     does not keep: a checkpoint of AdamW? Resume it with --optim adamw"
                )));
            }
            // A copy of its own: nothing of the caller's is kept.
            *part = Some(t.copy()?);
        }
        Ok(())
    }
}
