//! AdamW in one kernel per tensor (`adamw.cu`): fp32 masters and moments (or 8-bit moments with
//! fp32 block maxima) updated in place and the low-precision model weight written in the same
//! pass, or a bf16/f16 weight updated in place without a master (`--full-bf16`). The tensors are
//! updated through their device pointers, the effect of candle's `Var::set` (which also writes
//! into the existing storage) without the fifteen intermediate fp32 tensors of the op-by-op
//! update.
//!
//! - CPU reference: ft-trainer's host update, `optim::host_adamw::element` (the kernels'
//!   per-element arithmetic is its, operation for operation), and `optim::adamw8bit`.
//! - GPU check: `tests/cuda/optim.rs` here (against the formula), and ft-trainer's
//!   `tests/cuda.rs` (against the host update, bit for bit); logic without a GPU:
//!   `tests/emulated` (`adamw_case`, `adamw8bit_case`, the in-place cases).
//! - Timing: `cargo run --release --features cuda -p ft-kernels --example time_adamw`.

use candle_core::{bail, DType, Result, Tensor};

use super::launch::{device_of, elem_grid, launch, suffix, tensor_ptr, Arg};

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
