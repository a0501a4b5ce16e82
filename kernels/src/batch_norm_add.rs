//! Batch norm in training, a residual added and the ReLU as one op: a ResNet basic block's end,
//! `relu(bn2(conv2(h)) + shortcut)`.
//!
//! Separately, the batch norm's op ([`crate::batch_norm`]) returns its output, the join
//! ([`crate::add_relu`]) keeps it as an input, and candle's backward gives each of the join's
//! two inputs a zero tensor to add the masked gradient into before the batch norm's backward
//! reads it. Here the forward writes `max(round(x * a + b) + r, 0)` once (the batch norm's value
//! rounded to the dtype, then the sum, as the two ops round), the graph keeps the input, the
//! residual and the output, not the normalised map; the backward masks the output's gradient
//! where the output is positive, hands it to the residual and runs the batch norm's backward on
//! it. The values, statistics and gradients are the separate ops' bit for bit (tested).
//!
//! Four inputs do not fit a candle op (at most three), so the weight and bias travel stacked as
//! one [2, C] tensor, whose gradient candle splits back. CPU, f32 and f64, where the batch norm's
//! op runs; `FT_BN_ADD_OP=0` (or `FT_BATCH_NORM_OP=0`) runs the separate ops, as do other
//! devices and dtypes.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::batch_norm::{self, affine, normalise, slice, BatchStats, Float, Planes};

/// `relu(batch_norm_train(x) + residual)` for `x` and `residual` [N, C, H, W] (one shape) with
/// `weight` and `bias` [C], and the batch statistics. One op on the CPU in f32 and f64 (see the
/// module); elsewhere the separate ops, with the same values.
pub fn batch_norm_add_relu_train(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    residual: &Tensor,
) -> Result<(Tensor, BatchStats)> {
    let ours = batch_norm::takes(x)
        && op_enabled()
        && residual.device().is_cpu()
        && residual.dtype() == x.dtype()
        && residual.dims() == x.dims();
    if !ours {
        return separate(x, weight, bias, eps, residual);
    }
    let dt = x.dtype();
    let stacked = Tensor::stack(&[weight.to_dtype(dt)?, bias.to_dtype(dt)?], 0)?;
    let stats = Arc::new(Mutex::new(BatchStats::default()));
    let y = x.contiguous()?.apply_op3(
        &stacked.contiguous()?,
        &residual.contiguous()?,
        Forward {
            eps,
            stats: stats.clone(),
        },
    )?;
    Ok((y, batch_norm::taken(&stats)?))
}

/// The separate ops the op replaces: the batch norm's op and the join
/// ([`crate::add_relu::add_relu`]). The reference the op is tested against, and the path of
/// other devices and dtypes.
pub fn separate(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    residual: &Tensor,
) -> Result<(Tensor, BatchStats)> {
    let (y, stats) = batch_norm::batch_norm_train(x, weight, bias, eps)?;
    Ok((crate::add_relu::add_relu(&y, residual)?, stats))
}

/// `FT_BN_ADD_OP=0` turns the op off.
fn op_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switched_on(&ON, "FT_BN_ADD_OP")
}

const NAME: &str = "batch norm + residual + relu";

/// The forward: statistics, then each plane normalised, the residual added, the ReLU.
struct Forward {
    eps: f64,
    stats: Arc<Mutex<BatchStats>>,
}

impl Forward {
    fn run<T: Float>(&self, x: &[T], p: Planes, stacked: &[T], r: &[T]) -> Result<Vec<T>> {
        if stacked.len() != 2 * p.c || r.len() != x.len() {
            bail!(
                "{NAME}: {} channels and {} values, weight and bias of {} together, residual of {}",
                p.c,
                x.len(),
                stacked.len(),
                r.len()
            );
        }
        let (gamma, beta) = stacked.split_at(p.c);
        let (s, a, b) = affine(x, p, gamma, beta, self.eps)?;
        let mut y = vec![T::zero(); x.len()];
        if p.hw > 0 {
            y.par_chunks_mut(p.hw).enumerate().for_each(|(plane, out)| {
                let c = plane % p.c;
                let at = plane * p.hw;
                normalise(&x[at..at + p.hw], a[c], b[c], false, out);
                for (o, &r) in out.iter_mut().zip(&r[at..at + p.hw]) {
                    let v = *o + r;
                    *o = if v > T::zero() { v } else { T::zero() };
                }
            });
        }
        batch_norm::put(&self.stats, s)?;
        Ok(y)
    }
}

impl CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        "ft-batch-norm-add-relu"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        rs: &CpuStorage,
        rl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let p = Planes::of(xl.shape())?;
        let y = match (xs, rs) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(self.run(
                slice::<f32>(xs, xl, "the input")?,
                p,
                slice(ws, wl, "the weight and bias")?,
                slice(rs, rl, "the residual")?,
            )?),
            (CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(self.run(
                slice::<f64>(xs, xl, "the input")?,
                p,
                slice(ws, wl, "the weight and bias")?,
                slice(rs, rl, "the residual")?,
            )?),
            _ => bail!(
                "{NAME}: {:?} input and {:?} residual (f32 or f64, the same)",
                xs.dtype(),
                rs.dtype()
            ),
        };
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        stacked: &Tensor,
        _r: &Tensor,
        y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The join's backward: the gradient where the output is positive, to both sides.
        let dg = crate::add_relu::masked(dy, y)?;
        let stats = batch_norm::taken(&self.stats)?;
        let (gamma, beta) = (stacked.get(0)?, stacked.get(1)?);
        let (dx, dgamma, dbeta) =
            batch_norm::backward(x, &gamma, &beta, &dg, stats, self.eps, false)?;
        let dstacked = Tensor::stack(&[dgamma, dbeta], 0)?;
        Ok((Some(dx), Some(dstacked), Some(dg)))
    }
}
