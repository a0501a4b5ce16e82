//! A convolution and the training batch norm after it (with its ReLU, or its ReLU and max pool)
//! as one op: a CNN block's `conv, BN[, ReLU[, pool]]`.
//!
//! As two ops, the convolution's output is a node of the graph, and candle's backward gives its
//! gradient a slot: a zero tensor of the output's size, an add of the batch norm's input
//! gradient into it (a third map, written), and the two dropped, page by page, before the
//! convolution's backward reads the sum. In ResNet10's 84 px episode those slots, their adds
//! and their page faults were 17% of the backward's samples, the convolutions' outputs about
//! half of their bytes (the stem's alone 38 MB a map). Here the op keeps the convolution's output
//! itself (the bytes the graph kept), and its backward runs the batch norm's backward on it
//! and hands the input gradient straight to the convolution's backward: no slot, no add.
//!
//! The values are the two ops' bit for bit: the same convolution (its bias, where it has one,
//! inside it) and the same batch norm op run on its output. So are the gradients, but for the
//! sign of a zero: candle's `0 + g` turns a `-0.0` of the batch norm's input gradient into
//! `+0.0` before the convolution's backward reads it (tested with `==`, which takes the two
//! zeros as equal).
//!
//! What the op keeps beside the graph is counted in [`crate::op_kept`], for the checkpointer's
//! measure of a segment.
//!
//! Three inputs at most fit a candle op, so the batch norm's weight and bias (and the
//! convolution's bias, where there is one) travel stacked as one [2 or 3, C] tensor, whose
//! gradient candle splits back. CPU, f32 and f64, where the convolution and the batch norm take
//! their own ops; `FT_CONV_BN_OP=0` runs the separate ops (for a before-and-after measurement),
//! as do other devices and dtypes.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::by_image::{backward_tensors, forward_storage};
use super::Conv2d;
use crate::batch_norm::{self, BatchStats};
use crate::batch_norm_pool::{self, MaxPool};
use crate::grad_tap;

/// What follows the batch norm inside the op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BnTail {
    /// Nothing (a ResNet shortcut's batch norm).
    Plain,
    /// A ReLU (a ResNet block's first batch norm).
    Relu,
    /// A ReLU, zero padding and a max pool (Conv4's blocks, the ResNet stem).
    ReluMaxPool(MaxPool),
}

/// `tail(batch_norm_train(conv2d(x, weight, bias, stride, pad), gamma, beta, eps))`, the
/// convolution as [`super::conv2d`] and the batch norm as [`crate::batch_norm`] compute them.
#[derive(Debug, Clone, Copy)]
pub struct ConvBatchNorm<'a> {
    /// [O, C, k, k].
    pub weight: &'a Tensor,
    /// The convolution's bias, [O].
    pub bias: Option<&'a Tensor>,
    pub stride: usize,
    pub pad: usize,
    /// The batch norm's weight and bias, [O] each.
    pub gamma: &'a Tensor,
    pub beta: &'a Tensor,
    pub eps: f64,
    pub tail: BnTail,
}

impl ConvBatchNorm<'_> {
    /// The output for `x` [N, C, H, W] and the batch statistics of the convolution's output
    /// (for the running estimates): one op on the CPU in f32 and f64 (see the module), the
    /// separate ops elsewhere.
    pub fn train(&self, x: &Tensor) -> Result<(Tensor, BatchStats)> {
        let dt = x.dtype();
        let stats = Arc::new(Mutex::new(BatchStats::default()));
        let tail = match self.tail {
            BnTail::Plain => Some(batch_norm::train_op(self.eps, false, stats.clone())),
            BnTail::Relu => Some(batch_norm::train_op(self.eps, true, stats.clone())),
            BnTail::ReluMaxPool(pool) => batch_norm_pool::train_op(self.eps, pool, stats.clone()),
        };
        let ours = batch_norm::takes(x)
            && op_enabled()
            && self.weight.device().is_cpu()
            && self.weight.dtype() == dt
            && self
                .bias
                .is_none_or(|b| b.dtype() == dt && b.device().is_cpu());
        let Some(tail) = tail.filter(|_| ours) else {
            return self.separate(x);
        };
        let mut rows = vec![self.gamma.to_dtype(dt)?, self.beta.to_dtype(dt)?];
        if let Some(b) = self.bias {
            rows.push(b.clone());
        }
        let stacked = Tensor::stack(&rows, 0)?;
        let op = Fused {
            conv: Conv2d {
                stride: self.stride,
                pad: self.pad,
            },
            bias: self.bias.is_some(),
            tail,
            output: Mutex::new(None),
        };
        let (g, o) = op.conv.geometry(x.dims(), self.weight.dims())?;
        let y =
            x.contiguous()?
                .apply_op3(&self.weight.contiguous()?, &stacked.contiguous()?, op)?;
        if y.track_op() {
            // The convolution's output, kept by the op for as long as the graph holds it.
            let (oh, ow) = g.out_hw();
            crate::op_kept::add((g.b * o * oh * ow * dt.size_in_bytes()) as u64);
        }
        Ok((y, batch_norm::taken(&stats)?))
    }

    /// The separate ops the op replaces: [`super::conv2d`], then the batch norm's op with its
    /// tail. The reference the op is tested against, and the path of other devices and dtypes.
    pub fn separate(&self, x: &Tensor) -> Result<(Tensor, BatchStats)> {
        let z = super::conv2d(x, self.weight, self.bias, self.stride, self.pad)?;
        let (gamma, beta, eps) = (self.gamma, self.beta, self.eps);
        match self.tail {
            BnTail::Plain => batch_norm::batch_norm_train(&z, gamma, beta, eps),
            BnTail::Relu => batch_norm::batch_norm_relu_train(&z, gamma, beta, eps),
            BnTail::ReluMaxPool(pool) => {
                batch_norm_pool::batch_norm_relu_max_pool_train(&z, gamma, beta, eps, pool)
            }
        }
    }
}

/// Whether the CPU takes the op: `FT_CONV_BN_OP=0` turns it off.
fn op_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switched_on(&ON, "FT_CONV_BN_OP")
}

/// The op over (x, weight, [gamma; beta; conv bias]): the convolution, then `tail` (the batch
/// norm's own op) on its output, which it keeps for the backward.
struct Fused {
    conv: Conv2d,
    bias: bool,
    tail: Box<dyn CustomOp3 + Send + Sync>,
    /// The convolution's output, from the forward.
    output: Mutex<Option<Tensor>>,
}

impl Fused {
    /// Rows of the stacked tensor.
    fn rows(&self) -> usize {
        if self.bias {
            3
        } else {
            2
        }
    }
}

impl CustomOp3 for Fused {
    fn name(&self) -> &'static str {
        "ft-conv2d-batch-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, o) = self.conv.geometry(xl.dims(), wl.dims())?;
        if sl.dims() != [self.rows(), o] || !sl.is_contiguous() {
            bail!(
                "conv2d + batch norm: the stacked weight and biases are {:?}, not [{}, {o}]",
                sl.dims(),
                self.rows()
            );
        }
        // Row `r` of the stacked tensor as a [O] layout over its storage.
        let row = |r: usize| Layout::contiguous_with_offset(o, sl.start_offset() + r * o);
        let bias_row = row(2);
        let bias = self.bias.then_some((ss, &bias_row));
        let Some(z) = forward_storage((xs, xl), (ws, wl), bias, &g, o)? else {
            bail!("conv2d + batch norm: input, weight and biases must all be f32 or all f64")
        };
        let (oh, ow) = g.out_hw();
        let zl = Layout::contiguous((g.b, o, oh, ow));
        let y = self.tail.cpu_fwd(&z, &zl, ss, &row(0), ss, &row(1))?;
        let z = match z {
            CpuStorage::F32(v) => Tensor::from_vec(v, zl.shape(), &candle_core::Device::Cpu)?,
            CpuStorage::F64(v) => Tensor::from_vec(v, zl.shape(), &candle_core::Device::Cpu)?,
            other => bail!("conv2d + batch norm: {:?} output", other.dtype()),
        };
        *self
            .output
            .lock()
            .map_err(|_| candle_core::Error::Msg("conv2d + batch norm: poisoned".into()))? =
            Some(z);
        Ok(y)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        stacked: &Tensor,
        y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let z = self
            .output
            .lock()
            .map_err(|_| candle_core::Error::Msg("conv2d + batch norm: poisoned".into()))?
            .clone();
        let Some(z) = z else {
            bail!("conv2d + batch norm: backward before a forward")
        };
        let (g, o) = self.conv.geometry(x.dims(), w.dims())?;
        let rows = stacked.detach();
        let (gamma, beta) = (rows.get(0)?, rows.get(1)?);
        let (dz, dgamma, dbeta) = self.tail.bwd(&z, &gamma, &beta, y, dy)?;
        let (Some(dz), Some(dgamma), Some(dbeta)) = (dz, dgamma, dbeta) else {
            bail!("conv2d + batch norm: the batch norm's backward gave no gradient")
        };
        let bias = match self.bias {
            true => Some(rows.get(2)?),
            false => None,
        };
        let (dx, dw, db) = backward_tensors(x, w, bias.as_ref(), &dz, &g, o)?;
        let mut grads = vec![dgamma, dbeta];
        grads.extend(db);
        let dstacked = Tensor::stack(&grads, 0)?;
        if dstacked.dtype() != stacked.dtype() {
            bail!("conv2d + batch norm: {:?} gradients", dstacked.dtype());
        }
        Ok((dx, grad_tap::hand_over(w, Some(dw))?, Some(dstacked)))
    }
}
