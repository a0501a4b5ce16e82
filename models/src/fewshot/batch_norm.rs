//! BatchNorm2d with running statistics, as `torch.nn.BatchNorm2d` (momentum 0.1, eps 1e-5):
//! batch statistics in training (biased variance to normalise, unbiased for the running
//! estimate), running statistics in evaluation: with batch statistics one op with its own
//! backward ([`ft_kernels::batch_norm`]), with running ones a composition of candle ops.
//!
//! A checkpoint segment recomputed in backward runs its batch norms a second time on the same
//! input: [`BnMode::Recompute`] gives the same batch statistics without moving the running ones
//! again, so that a recomputed step leaves them where plain backprop does.

/// Which statistics normalise, and whether the running ones move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BnMode {
    /// Running statistics (evaluation).
    Eval,
    /// Batch statistics, and the running ones updated (a training forward).
    Train,
    /// Batch statistics, running ones left alone (a segment's recomputation in backward).
    Recompute,
}

impl BnMode {
    /// `Train` or `Eval`.
    pub fn of(train: bool) -> Self {
        if train {
            BnMode::Train
        } else {
            BnMode::Eval
        }
    }
}

use candle_core::{Tensor, Var};
use ft_params::{Init, ParamBuilder};

use crate::error::Result;

#[derive(Clone)]
pub struct BatchNorm2d {
    weight: Tensor,
    bias: Tensor,
    running_mean: Var,
    running_var: Var,
    eps: f64,
    momentum: f64,
}

impl BatchNorm2d {
    pub fn new(pb: &ParamBuilder, channels: usize) -> Result<Self> {
        Ok(BatchNorm2d {
            weight: pb.get(&[channels], "weight", Init::Ones)?,
            bias: pb.get(&[channels], "bias", Init::Zeros)?,
            running_mean: pb.buffer(&[channels], "running_mean", Init::Zeros)?,
            running_var: pb.buffer(&[channels], "running_var", Init::Ones)?,
            eps: 1e-5,
            momentum: 0.1,
        })
    }

    /// The trainable tensors (not the running statistics), for checkpoint segments.
    pub fn tensors(&self) -> Vec<Tensor> {
        vec![self.weight.clone(), self.bias.clone()]
    }

    /// Normalises [N, C, H, W]; under [`BnMode::Train`] also updates the running statistics.
    /// With batch statistics it is one op ([`ft_kernels::batch_norm`]: on the CPU it keeps
    /// its input alone for backward, not six tensors of its size).
    pub fn forward(&self, x: &Tensor, mode: BnMode) -> candle_core::Result<Tensor> {
        self.normalise(x, mode, false)
    }

    /// [`Self::forward`] and a ReLU: with batch statistics one op on the CPU
    /// ([`ft_kernels::batch_norm::batch_norm_relu_train`]), which keeps no map for the ReLU and
    /// makes none in its backward.
    pub fn forward_relu(&self, x: &Tensor, mode: BnMode) -> candle_core::Result<Tensor> {
        self.normalise(x, mode, true)
    }

    fn normalise(&self, x: &Tensor, mode: BnMode, relu: bool) -> candle_core::Result<Tensor> {
        let (n, c, h, w) = x.dims4()?;
        if mode != BnMode::Eval {
            use ft_kernels::batch_norm::{batch_norm_relu_train, batch_norm_train};
            let op = if relu {
                batch_norm_relu_train
            } else {
                batch_norm_train
            };
            let (y, stats) = op(x, &self.weight, &self.bias, self.eps)?;
            if mode == BnMode::Train {
                let device = self.running_mean.device();
                let mean = Tensor::new(stats.mean.as_slice(), device)?;
                let var = Tensor::new(stats.var.as_slice(), device)?;
                self.update_running(&mean, &var, (n * h * w) as f64)?;
            }
            return Ok(y);
        }
        let shape = (1, c, 1, 1);
        let mean = self.running_mean.as_tensor().reshape(shape)?;
        let var = self.running_var.as_tensor().reshape(shape)?;
        let y = x
            .broadcast_sub(&mean)?
            .broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let y = y
            .broadcast_mul(&self.weight.reshape(shape)?)?
            .broadcast_add(&self.bias.reshape(shape)?)?;
        if relu {
            y.relu()
        } else {
            Ok(y)
        }
    }

    /// Moves the running statistics towards this batch's (momentum 0.1, unbiased variance).
    fn update_running(&self, mean: &Tensor, var: &Tensor, count: f64) -> candle_core::Result<()> {
        let dtype = self.running_mean.dtype();
        let unbiased = (var.to_dtype(dtype)? * (count / (count - 1.0).max(1.0)))?;
        let m = self.momentum;
        self.running_mean
            .set(&((self.running_mean.as_tensor() * (1.0 - m))? + (mean.to_dtype(dtype)? * m)?)?)?;
        self.running_var
            .set(&((self.running_var.as_tensor() * (1.0 - m))? + (unbiased * m)?)?)
    }
}
