//! Adafactor's update (`adafactor.cu`) in five or six kernel launches per tensor (six where a column's sum needs
//! more than one chunk of 32 rows; two under two dims), where the op-by-op update makes about 35
//! candle ops, most of them passes over fp32 copies of the whole tensor.
//!
//! The arithmetic is ft-trainer's `optim::adafactor`, operation for operation; only the order of
//! the sums differs from the host's (each is fixed, so a step is deterministic), so a GPU step
//! agrees with the CPU's to rounding, not bit for bit.
//!
//! - CPU reference: ft-trainer's `optim::adafactor` (`Adafactor::step_host`).
//! - GPU check: ft-trainer's `tests/cuda.rs` (`adafactor_on_the_gpu_matches_the_host`); logic
//!   without a GPU: `tests/emulated` (`adafactor_case`, `adafactor_in_place_case`).
//! - Timing: `cargo run --release --features cuda -p ft-kernels --example time_adafactor`.

use candle_core::{bail, DType, Result, Tensor};

use super::adamw::{check_f32_like, check_in_place, model_arg};
use super::launch::{device_of, elem_grid, launch, out_ptr, output, suffix, tensor_ptr, Arg};

/// One Adafactor update's scalars (transformers' names), for HF Trainer's and kohya's
/// configuration: no first moment, no parameter scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdafactorStep {
    /// The step size: the schedule's learning rate, or the relative step.
    pub lr: f64,
    /// Added to the squared gradient.
    pub eps1: f64,
    /// `1 - t^decay_rate`: the second moment's decay at this step.
    pub beta2t: f64,
    /// Bound on the update's RMS.
    pub clip_threshold: f64,
    pub weight_decay: f64,
    /// Factor applied to the gradient first (1 / loss scale, a clipping coefficient, or 1).
    pub grad_mul: f64,
    /// Non-zero: write a bf16 model weight with stochastic rounding from this seed.
    pub seed: u64,
}

/// A tensor's second moment as Adafactor keeps it, fp32 and contiguous, updated in place.
pub enum SecondMoment<'a> {
    /// A tensor of shape `[.., R, C]` (two or more dims), with `B` the product of the leading
    /// dims: `row` holds `B R` values (`exp_avg_sq_row`), `col` holds `B C` (`exp_avg_sq_col`).
    Factored { row: &'a Tensor, col: &'a Tensor },
    /// One value per weight (`exp_avg_sq`), for tensors under two dims.
    Full(&'a Tensor),
}

/// One Adafactor step on CUDA: the fp32 `master` and the second moment `v` updated in place
/// from `grad` (f32/bf16/f16, the parameter's shape), the model weight written in the same pass
/// when given.
pub fn adafactor_fused(
    master: &Tensor,
    v: &SecondMoment<'_>,
    grad: &Tensor,
    model: Option<&Tensor>,
    s: &AdafactorStep,
) -> Result<()> {
    launch_all(Some(master), v, grad, model, s)
}

/// [`adafactor_fused`] on a bf16/f16 weight trained without an fp32 master (`--full-bf16`):
/// read, updated and written back in place, a bf16 weight rounded stochastically when `s.seed`
/// is not 0.
pub fn adafactor_fused_in_place(
    weight: &Tensor,
    v: &SecondMoment<'_>,
    grad: &Tensor,
    s: &AdafactorStep,
) -> Result<()> {
    check_in_place("adafactor_fused_in_place", weight)?;
    launch_all(None, v, grad, Some(weight), s)
}

/// Rows a column-sum thread adds before the chunks are added in order: enough threads for a
/// large matrix (a 5120 x 1280 weight gets 160 x 1280), one chunk for a convolution's 3 x 3.
const COL_CHUNK: usize = 32;
/// The grid of the two element kernels: 1,024 blocks of 256 threads fill an H100 (132 SMs of
/// 2,048 threads) once, in grid-stride loops. It is also the number of partial sums of the
/// update's squares, which each block of the update kernel adds before it starts: capping its
/// grid too keeps that to a million cached reads per tensor instead of about four per weight.
const GRID: u32 = 1024;

/// How the row-sum kernels take `rows` rows of `len` values: a warp per row (8 rows to a
/// 256-thread block), or a thread per row when a row is shorter than a warp (a 3x3 kernel's
/// rows, which would leave 29 of 32 lanes idle). The flag and the grid.
fn row_grid(rows: usize, len: usize, who: &str) -> Result<(Arg, u32)> {
    let per_thread = len < 32;
    let per_block = if per_thread { 256 } else { 8 };
    let grid = u32::try_from(rows.div_ceil(per_block))
        .ok()
        .filter(|b| *b <= i32::MAX as u32)
        .ok_or_else(|| candle_core::Error::Msg(format!("{who}: {rows} rows in one tensor")))?;
    Ok((Arg::I32(per_thread as i32), grid))
}

fn dim_i32(d: usize, who: &str) -> Result<i32> {
    i32::try_from(d).map_err(|_| candle_core::Error::Msg(format!("{who}: dimension {d}")))
}

fn launch_all(
    master: Option<&Tensor>,
    v: &SecondMoment<'_>,
    grad: &Tensor,
    model: Option<&Tensor>,
    s: &AdafactorStep,
) -> Result<()> {
    const WHO: &str = "adafactor_fused";
    let n = grad.elem_count();
    if !grad.is_contiguous() {
        bail!("{WHO}: the gradient must be contiguous");
    }
    if let Some(master) = master {
        check_f32_like("master", master, n)?;
    }
    let (model_ptr, model_sfx, seed) = model_arg(model, n, s.seed, WHO)?;
    if n == 0 {
        return Ok(());
    }
    let dims = grad.dims();
    let dev = device_of(grad)?;
    let gs = suffix(grad.dtype())?;
    let (r, c, b) = match dims.len() {
        0 | 1 => (1, 1, 1),
        k => (dims[k - 2], dims[k - 1], dims[..k - 2].iter().product()),
    };
    let (ri, ci) = (dim_i32(r, WHO)?, dim_i32(c, WHO)?);
    let scalars = [
        s.grad_mul as f32,
        s.eps1 as f32,
        s.beta2t as f32,
        (1.0 - s.beta2t) as f32,
        (1.0 / r as f64) as f32,
        (1.0 / c as f64) as f32,
        s.lr as f32,
        // candle's `lr_t.affine(-wd, 0)` in f32; 0 stands for no weight decay.
        if s.weight_decay != 0.0 {
            (s.lr as f32) * (-s.weight_decay as f32) + 0.0
        } else {
            0.0
        },
        (1.0 / (n as f64).sqrt()) as f32,
        (1.0 / s.clip_threshold) as f32,
    ]
    .map(Arg::F32);
    let with = |head: &[Arg]| -> Vec<Arg> { head.iter().chain(&scalars).copied().collect() };
    let g = Arg::Ptr(tensor_ptr(grad)?);
    // The second moment's buffers, and the row means the factored update divides by (kept
    // alive until the apply kernel is queued; candle frees stream-ordered).
    let (row, col, rmean) = match (v, dims.len() >= 2) {
        (SecondMoment::Factored { row, col }, true) => {
            check_f32_like("exp_avg_sq_row", row, b * r)?;
            check_f32_like("exp_avg_sq_col", col, b * c)?;
            let (row, col) = (tensor_ptr(row)?, tensor_ptr(col)?);
            let (per_thread, grid) = row_grid(b * r, c, WHO)?;
            launch(
                &dev,
                &format!("adafactor_rows_{gs}"),
                (grid, 1),
                256,
                &with(&[
                    g,
                    Arg::Ptr(row),
                    Arg::I64((b * r) as i64),
                    Arg::I32(ci),
                    per_thread,
                ]),
            )?;
            let (bc, chunks) = (b * c, r.div_ceil(COL_CHUNK));
            let part = (chunks > 1)
                .then(|| output(&dev, DType::F32, bc * chunks))
                .transpose()?;
            let part_ptr = part.as_ref().map(out_ptr).transpose()?.unwrap_or(0);
            launch(
                &dev,
                &format!("adafactor_col_parts_{gs}"),
                (elem_grid(bc * chunks), 1),
                256,
                &with(&[
                    g,
                    Arg::Ptr(col),
                    Arg::Ptr(part_ptr),
                    Arg::I64(bc as i64),
                    Arg::I32(ri),
                    Arg::I32(ci),
                    Arg::I32(COL_CHUNK as i32),
                    Arg::I32(chunks as i32),
                ]),
            )?;
            if part.is_some() {
                launch(
                    &dev,
                    "adafactor_cols",
                    (elem_grid(bc), 1),
                    256,
                    &with(&[
                        Arg::Ptr(part_ptr),
                        Arg::Ptr(col),
                        Arg::I64(bc as i64),
                        Arg::I32(chunks as i32),
                    ]),
                )?;
            }
            let rmean = output(&dev, DType::F32, b)?;
            let (per_thread, grid) = row_grid(b, r, WHO)?;
            launch(
                &dev,
                "adafactor_row_mean",
                (grid, 1),
                256,
                &[
                    Arg::Ptr(row),
                    Arg::Ptr(out_ptr(&rmean)?),
                    Arg::I64(b as i64),
                    Arg::I32(ri),
                    per_thread,
                    Arg::F32((1.0 / r as f64) as f32),
                ],
            )?;
            (row, col, Some(rmean))
        }
        (SecondMoment::Full(v), false) => {
            check_f32_like("exp_avg_sq", v, n)?;
            (tensor_ptr(v)?, 0, None)
        }
        _ => bail!(
            "{WHO}: a tensor of shape {dims:?} keeps a {} second moment",
            if dims.len() >= 2 { "factored" } else { "full" }
        ),
    };
    let rmean_ptr = rmean.as_ref().map(out_ptr).transpose()?.unwrap_or(0);
    let parts = elem_grid(n).min(GRID);
    let part = output(&dev, DType::F32, parts as usize)?;
    let part_ptr = out_ptr(&part)?;
    launch(
        &dev,
        &format!("adafactor_sumsq_{gs}"),
        (parts, 1),
        256,
        &with(&[
            g,
            Arg::Ptr(row),
            Arg::Ptr(rmean_ptr),
            Arg::Ptr(col),
            Arg::Ptr(part_ptr),
            Arg::I64(n as i64),
            Arg::I32(ri),
            Arg::I32(ci),
        ]),
    )?;
    let mut args = with(&[
        Arg::Ptr(master.map(tensor_ptr).transpose()?.unwrap_or(0)),
        g,
        Arg::Ptr(model_ptr),
        Arg::Ptr(row),
        Arg::Ptr(rmean_ptr),
        Arg::Ptr(col),
        Arg::Ptr(part_ptr),
        Arg::I32(parts as i32),
        Arg::I64(n as i64),
        Arg::I32(ri),
        Arg::I32(ci),
    ]);
    args.push(Arg::U64(seed));
    launch(
        &dev,
        &format!("adafactor_apply_{gs}_{model_sfx}"),
        (parts, 1),
        256,
        &args,
    )
}
