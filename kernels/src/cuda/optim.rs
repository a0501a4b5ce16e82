//! Fused casts around the optimizer step: AdamW on fp32 masters writing the low-precision model
//! weight in the same pass, gradient unscale + inf/NaN check + cast to fp32 with one read-back
//! for all gradients, and fp32 -> bf16 stochastic rounding.
//!
//! The AdamW step updates tensors in place through their device pointers, the same effect as
//! candle's `Var::set` (which also writes into the existing storage) without the fifteen
//! intermediate fp32 tensors of the op-by-op update.

use candle_core::{bail, DType, Result, Tensor};

use super::{
    device_of, elem_grid, into_tensor, launch, out_ptr, output, suffix, tensor_ptr, zeros, Arg,
};

/// One AdamW update's scalars, as `torch.optim.AdamW` derives them for step `t`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f64,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f64,
    /// Factor applied to the gradient first (1 / loss scale, a clipping coefficient, or 1).
    pub grad_mul: f64,
    /// The first update of these moments: their previous contents are ignored.
    pub first: bool,
    /// Non-zero: write a bf16 model weight with stochastic rounding from this seed.
    pub seed: u64,
}

/// An in-place update (no fp32 master) takes a bf16/f16 weight: an fp32 one is its own master.
pub(super) fn check_in_place(who: &str, weight: &Tensor) -> Result<()> {
    if !matches!(weight.dtype(), DType::BF16 | DType::F16) {
        bail!(
            "{who}: a bf16/f16 weight, got {:?} (an fp32 one is its own master)",
            weight.dtype()
        );
    }
    Ok(())
}

pub(super) fn check_f32_like(name: &str, t: &Tensor, n: usize) -> Result<()> {
    if t.dtype() != DType::F32 || t.elem_count() != n || !t.is_contiguous() {
        bail!(
            "optimizer kernel: {name} must be a contiguous f32 tensor of {n} elements, got {:?} {:?}",
            t.dtype(),
            t.dims()
        );
    }
    Ok(())
}

/// One AdamW step on the CUDA tensors `master` (fp32 weights), `m`, `v` (fp32 moments), in
/// place, from `grad` (f32/bf16/f16); writes the updated weight into `model` (f32/bf16/f16) when
/// given. All contiguous, of one element count.
pub fn adamw_fused(
    master: &Tensor,
    m: &Tensor,
    v: &Tensor,
    grad: &Tensor,
    model: Option<&Tensor>,
    s: &AdamWStep,
) -> Result<()> {
    adamw_launch(Some(master), m, v, grad, model, s)
}

/// One AdamW step on a bf16/f16 CUDA weight trained without an fp32 master (`--full-bf16`):
/// read, updated and written back in place in the same pass as the moments, a bf16 weight
/// rounded stochastically when `s.seed` is not 0 (the bits `ft_kernels::rounding` gives on the
/// CPU for that seed).
pub fn adamw_fused_in_place(
    weight: &Tensor,
    m: &Tensor,
    v: &Tensor,
    grad: &Tensor,
    s: &AdamWStep,
) -> Result<()> {
    check_in_place("adamw_fused_in_place", weight)?;
    adamw_launch(None, m, v, grad, Some(weight), s)
}

fn adamw_launch(
    master: Option<&Tensor>,
    m: &Tensor,
    v: &Tensor,
    grad: &Tensor,
    model: Option<&Tensor>,
    s: &AdamWStep,
) -> Result<()> {
    let n = m.elem_count();
    if let Some(master) = master {
        check_f32_like("master", master, n)?;
    }
    check_f32_like("exp_avg", m, n)?;
    check_f32_like("exp_avg_sq", v, n)?;
    if grad.elem_count() != n || !grad.is_contiguous() {
        bail!(
            "adamw_fused: gradient {:?} does not match {n} weights",
            grad.dims()
        );
    }
    let (model_ptr, model_sfx, seed) = model_arg(model, n, s.seed, "adamw_fused")?;
    let dev = device_of(m)?;
    let mut args = vec![
        Arg::Ptr(master.map(tensor_ptr).transpose()?.unwrap_or(0)),
        Arg::Ptr(tensor_ptr(m)?),
        Arg::Ptr(tensor_ptr(v)?),
        Arg::Ptr(tensor_ptr(grad)?),
        Arg::Ptr(model_ptr),
        Arg::I64(n as i64),
    ];
    args.extend(step_args(s, seed));
    launch(
        &dev,
        &format!("adamw_{}_{model_sfx}", suffix(grad.dtype())?),
        (elem_grid(n), 1),
        256,
        &args,
    )
}

/// The kernel arguments every AdamW entry point ends with, in order: the scalars rounded to f32
/// from their f64 values as the host update (`ft_trainer`'s `optim::host_adamw`) rounds them, so that
/// the kernels' per-element arithmetic gives the host's bits.
fn step_args(s: &AdamWStep, seed: u64) -> [Arg; 11] {
    // 0 stands for "no weight decay" (a real factor is near 1): the host skips the multiply
    // exactly when the f64 weight decay is 0, even where the f32 factor rounds to 1.
    let decay = if s.weight_decay != 0.0 {
        (1.0 - s.lr * s.weight_decay) as f32
    } else {
        0.0
    };
    [
        Arg::F32(decay),
        Arg::F32(s.beta1 as f32),
        Arg::F32(s.beta2 as f32),
        Arg::F32((1.0 - s.beta1) as f32),
        Arg::F32((1.0 - s.beta2) as f32),
        Arg::F32(s.eps as f32),
        Arg::F32(s.step_size as f32),
        Arg::F32((1.0 / s.bc2_sqrt) as f32),
        Arg::F32(s.grad_mul as f32),
        Arg::I32(s.first as i32),
        Arg::U64(seed),
    ]
}

/// The model weight's pointer and dtype suffix (null and `f32` when there is none), and the
/// stochastic-rounding seed that applies to it (bf16 weights only).
pub(super) fn model_arg(
    model: Option<&Tensor>,
    n: usize,
    seed: u64,
    who: &str,
) -> Result<(u64, &'static str, u64)> {
    Ok(match model {
        Some(w) => {
            if w.elem_count() != n || !w.is_contiguous() {
                bail!("{who}: model weight {:?} does not match {n}", w.dims());
            }
            let seed = if w.dtype() == DType::BF16 { seed } else { 0 };
            (tensor_ptr(w)?, suffix(w.dtype())?, seed)
        }
        None => (0, "f32", 0),
    })
}

/// Blockwise 8-bit AdamW moments on one CUDA device, as `ft_trainer::optim::adamw8bit` lays them out:
/// one byte per value indexing a 256-value map, one fp32 absolute maximum per 256 values.
pub struct Moments8bit<'a> {
    /// First-moment codes (U8, one per weight) into the signed map.
    pub m: &'a Tensor,
    /// Second-moment codes (U8) into the unsigned map.
    pub v: &'a Tensor,
    /// First-moment block maxima (F32, one per 256 weights).
    pub m_max: &'a Tensor,
    /// Second-moment block maxima (F32).
    pub v_max: &'a Tensor,
    /// The signed map, then the unsigned one: 512 F32 values, ascending within each.
    pub maps: &'a Tensor,
}

/// One 8-bit AdamW step on CUDA, in place: the fp32 `master` and all of `q` are updated, and the
/// model weight written when given, in one pass (one CUDA block per 256 weights; the new moments
/// are quantized against their block's new maximum). `grad` is f32/bf16/f16. With
/// `s.first` the previous codes and maxima are ignored.
pub fn adamw8bit_fused(
    master: &Tensor,
    q: &Moments8bit<'_>,
    grad: &Tensor,
    model: Option<&Tensor>,
    s: &AdamWStep,
) -> Result<()> {
    adamw8bit_launch(Some(master), q, grad, model, s)
}

/// [`adamw8bit_fused`] on a bf16/f16 weight trained without an fp32 master (`--full-bf16`):
/// read, updated and written back in place, a bf16 weight rounded stochastically when `s.seed`
/// is not 0 (as [`adamw_fused_in_place`]).
pub fn adamw8bit_fused_in_place(
    weight: &Tensor,
    q: &Moments8bit<'_>,
    grad: &Tensor,
    s: &AdamWStep,
) -> Result<()> {
    check_in_place("adamw8bit_fused_in_place", weight)?;
    adamw8bit_launch(None, q, grad, Some(weight), s)
}

fn adamw8bit_launch(
    master: Option<&Tensor>,
    q: &Moments8bit<'_>,
    grad: &Tensor,
    model: Option<&Tensor>,
    s: &AdamWStep,
) -> Result<()> {
    let n = q.m.elem_count();
    let blocks = n.div_ceil(256);
    if let Some(master) = master {
        check_f32_like("master", master, n)?;
    }
    check_f32_like("exp_avg_absmax", q.m_max, blocks)?;
    check_f32_like("exp_avg_sq_absmax", q.v_max, blocks)?;
    check_f32_like("quantization maps", q.maps, 512)?;
    for (name, t) in [("exp_avg", q.m), ("exp_avg_sq", q.v)] {
        if t.dtype() != DType::U8 || t.elem_count() != n || !t.is_contiguous() {
            bail!(
                "adamw8bit_fused: {name} must be contiguous u8 codes of {n} elements, got {:?} {:?}",
                t.dtype(),
                t.dims()
            );
        }
    }
    if grad.elem_count() != n || !grad.is_contiguous() {
        bail!(
            "adamw8bit_fused: gradient {:?} does not match {n} weights",
            grad.dims()
        );
    }
    let (model_ptr, model_sfx, seed) = model_arg(model, n, s.seed, "adamw8bit_fused")?;
    let dev = device_of(q.m)?;
    // A grid's x dimension holds at most 2^31 - 1 blocks (5.5e11 weights in one tensor).
    let grid = u32::try_from(blocks)
        .ok()
        .filter(|b| *b <= i32::MAX as u32)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!("adamw8bit_fused: {n} weights in one tensor"))
        })?;
    let mut args = vec![
        Arg::Ptr(master.map(tensor_ptr).transpose()?.unwrap_or(0)),
        Arg::Ptr(tensor_ptr(q.m)?),
        Arg::Ptr(tensor_ptr(q.v)?),
        Arg::Ptr(tensor_ptr(q.m_max)?),
        Arg::Ptr(tensor_ptr(q.v_max)?),
        Arg::Ptr(tensor_ptr(grad)?),
        Arg::Ptr(model_ptr),
        Arg::Ptr(tensor_ptr(q.maps)?),
        Arg::I64(n as i64),
    ];
    args.extend(step_args(s, seed));
    // Exactly 256 threads a block: the kernel maps one thread to one value of a block.
    launch(
        &dev,
        &format!("adamw8bit_{}_{model_sfx}", suffix(grad.dtype())?),
        (grid, 1),
        256,
        &args,
    )
}

/// Replaces every gradient by `g * inv_scale` in fp32 and reports whether any element is inf
/// or NaN, reading one flag back for all of them (a per-tensor check costs one host sync per
/// parameter: 1,680 for the SDXL UNet).
pub fn unscale_check(grads: &mut [Option<Tensor>], inv_scale: f64) -> Result<bool> {
    let Some(first) = grads.iter().flatten().next() else {
        return Ok(false);
    };
    let dev = device_of(first)?;
    let found = zeros(&dev, DType::I32, 1)?;
    let found_ptr = out_ptr(&found)?;
    for g in grads.iter_mut().flatten() {
        let src = g.contiguous()?;
        let n = src.elem_count();
        let out = output(&dev, DType::F32, n)?;
        launch(
            &dev,
            &format!("unscale_{}", suffix(src.dtype())?),
            (elem_grid(n), 1),
            256,
            &[
                Arg::Ptr(tensor_ptr(&src)?),
                Arg::Ptr(out_ptr(&out)?),
                Arg::I64(n as i64),
                Arg::F32(inv_scale as f32),
                Arg::Ptr(found_ptr),
            ],
        )?;
        *g = into_tensor(out, src.shape());
    }
    let flag = into_tensor(found, 1).to_vec1::<i32>()?;
    Ok(flag.first().copied().unwrap_or(0) != 0)
}

/// The sum of squares of every element of every gradient (f32/bf16/f16 on one CUDA device),
/// accumulated in f64 across blocks, with one read-back for all of them: the global norm for
/// gradient clipping is its square root.
pub fn sum_squares(grads: &[Option<Tensor>]) -> Result<f64> {
    let Some(first) = grads.iter().flatten().next() else {
        return Ok(0.0);
    };
    let dev = device_of(first)?;
    let acc = zeros(&dev, DType::F64, 1)?;
    let acc_ptr = out_ptr(&acc)?;
    for g in grads.iter().flatten() {
        add_squares(&dev, g, acc_ptr)?;
    }
    let total = into_tensor(acc, 1).to_vec1::<f64>()?;
    Ok(total.first().copied().unwrap_or(0.0))
}

/// The sum of squares of each tensor (f32/bf16/f16 on one CUDA device) apart, with one
/// read-back for all of them: per-tensor clipping (a fused backward pass) for a whole
/// checkpointed segment at once instead of one host sync per tensor.
pub fn sum_squares_each(grads: &[Tensor]) -> Result<Vec<f64>> {
    let Some(first) = grads.first() else {
        return Ok(Vec::new());
    };
    let dev = device_of(first)?;
    let acc = zeros(&dev, DType::F64, grads.len())?;
    let base = out_ptr(&acc)?;
    for (i, g) in grads.iter().enumerate() {
        add_squares(&dev, g, base + 8 * i as u64)?;
    }
    into_tensor(acc, grads.len()).to_vec1::<f64>()
}

/// Adds the squares of `g`'s elements into the f64 at `acc` (one kernel).
fn add_squares(dev: &candle_core::CudaDevice, g: &Tensor, acc: u64) -> Result<()> {
    let src = g.contiguous()?;
    let n = src.elem_count();
    launch(
        dev,
        &format!("sum_squares_{}", suffix(src.dtype())?),
        (elem_grid(n).min(1024), 1),
        256,
        &[
            Arg::Ptr(tensor_ptr(&src)?),
            Arg::I64(n as i64),
            Arg::Ptr(acc),
        ],
    )
}

/// fp32 -> bf16 with stochastic rounding on CUDA (see [`crate::rounding`] for the rule).
pub fn round_stochastic_bf16(x: &Tensor, seed: u64) -> Result<Tensor> {
    if x.dtype() != DType::F32 {
        bail!("round_stochastic_bf16 takes f32, got {:?}", x.dtype());
    }
    let x = x.contiguous()?;
    let dev = device_of(&x)?;
    let n = x.elem_count();
    let out = output(&dev, DType::BF16, n)?;
    launch(
        &dev,
        "round_stochastic_bf16",
        (elem_grid(n), 1),
        256,
        &[
            Arg::Ptr(tensor_ptr(&x)?),
            Arg::Ptr(out_ptr(&out)?),
            Arg::I64(n as i64),
            Arg::U64(seed),
        ],
    )?;
    Ok(into_tensor(out, x.shape()))
}
