//! BatchNorm2d with running statistics, as `torch.nn.BatchNorm2d` (momentum 0.1, eps 1e-5):
//! batch statistics in training (biased variance to normalise, unbiased for the running
//! estimate), running statistics in evaluation: with batch statistics one op with its own
//! backward ([`ft_kernels::batch_norm`]), with running ones a per-channel scale and shift.
//!
//! A checkpoint segment recomputed in backward runs its batch norms a second time on the same
//! input: [`BnMode::Recompute`] gives the same batch statistics without moving the running ones
//! again, so that a recomputed step leaves them where plain backprop does.

/// Which statistics normalise, and whether the running ones move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BnMode {
    /// Running statistics (evaluation).
    Eval,
    /// Running statistics in an evaluation no gradient will go through (a backbone run under
    /// `Checkpointer::inference`, which detaches each block's output): a batch norm with the
    /// ReLU and pooling after it is then one op with no graph on the CPU (f32, f64), so it
    /// must not be used where a gradient is wanted; the others compute as under `Eval`.
    Infer,
    /// Batch statistics, and the running ones updated (a training forward).
    Train,
    /// Batch statistics, running ones left alone (a segment's recomputation in backward).
    Recompute,
}

impl BnMode {
    /// Whether the batch's statistics normalise (training and its recomputation).
    fn batch_statistics(self) -> bool {
        matches!(self, BnMode::Train | BnMode::Recompute)
    }

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
use ft_kernels::batch_norm::BatchStats;
use ft_kernels::batch_norm_add::batch_norm_add_relu_train;
use ft_kernels::batch_norm_pool::{affine_relu_max_pool, batch_norm_relu_max_pool_train, MaxPool};
use ft_kernels::conv::{BnTail, ConvBatchNorm};
use ft_params::{Init, ParamBuilder};

use crate::error::Result;
use crate::layers::Conv2d;

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

    /// [`Self::forward_relu`], zero padding and max pooling: with batch statistics one op on the
    /// CPU ([`ft_kernels::batch_norm_pool`]), whose graph keeps its input and the pooled output,
    /// not the normalised map between them.
    pub fn forward_relu_max_pool(
        &self,
        x: &Tensor,
        mode: BnMode,
        pool: MaxPool,
    ) -> candle_core::Result<Tensor> {
        if mode.batch_statistics() {
            return self.with_batch_statistics(x, mode, |x, w, b, eps| {
                batch_norm_relu_max_pool_train(x, w, b, eps, pool)
            });
        }
        if mode == BnMode::Infer {
            let (scale, shift) = self.running_affine()?;
            return affine_relu_max_pool(x, &scale, &shift, pool);
        }
        let h = self.normalise(x, mode, true)?;
        let h = match pool.pad {
            0 => h,
            p => h.pad_with_zeros(2, p, p)?.pad_with_zeros(3, p, p)?,
        };
        ft_kernels::pool::max_pool2d(&h, pool.kernel, pool.stride)
    }

    /// `relu(self.forward(x) + residual)`, a ResNet block's end: with batch statistics one op
    /// on the CPU ([`ft_kernels::batch_norm_add`]), whose graph keeps the input, the residual
    /// and the output, not the normalised map.
    pub fn forward_add_relu(
        &self,
        x: &Tensor,
        residual: &Tensor,
        mode: BnMode,
    ) -> candle_core::Result<Tensor> {
        if mode.batch_statistics() {
            return self.with_batch_statistics(x, mode, |x, w, b, eps| {
                batch_norm_add_relu_train(x, w, b, eps, residual)
            });
        }
        ft_kernels::add_relu::add_relu(&self.normalise(x, mode, false)?, residual)
    }

    /// `op` of `x` with the batch statistics, which under [`BnMode::Train`] also move the
    /// running ones.
    fn with_batch_statistics(
        &self,
        x: &Tensor,
        mode: BnMode,
        op: impl FnOnce(&Tensor, &Tensor, &Tensor, f64) -> candle_core::Result<(Tensor, BatchStats)>,
    ) -> candle_core::Result<Tensor> {
        let (n, _, h, w) = x.dims4()?;
        let (y, stats) = op(x, &self.weight, &self.bias, self.eps)?;
        self.moved_by(&stats, (n * h * w) as f64, mode)?;
        Ok(y)
    }

    /// The batch norm of `conv.forward(x)` and its `tail` (as [`Self::forward`],
    /// [`Self::forward_relu`] or [`Self::forward_relu_max_pool`] on it). With batch
    /// statistics one op on the CPU ([`ft_kernels::conv::ConvBatchNorm`]): the convolution's
    /// output is no node of the graph, so candle's backward forms no zeroed slot and add for
    /// its gradient.
    pub fn forward_conv(
        &self,
        conv: &Conv2d,
        x: &Tensor,
        mode: BnMode,
        tail: BnTail,
    ) -> candle_core::Result<Tensor> {
        if !mode.batch_statistics() {
            let z = conv.forward(x)?;
            return match tail {
                BnTail::Plain => self.forward(&z, mode),
                BnTail::Relu => self.forward_relu(&z, mode),
                BnTail::ReluMaxPool(pool) => self.forward_relu_max_pool(&z, mode, pool),
            };
        }
        let spec = ConvBatchNorm {
            weight: &conv.weight,
            bias: conv.bias.as_ref(),
            stride: conv.stride,
            pad: conv.padding,
            gamma: &self.weight,
            beta: &self.bias,
            eps: self.eps,
            tail,
        };
        let (y, stats) = spec.train(x)?;
        // The statistics are the convolution output's: its positions per channel.
        let (n, _, h, w) = x.dims4()?;
        let k = conv.weight.dim(2)?;
        let out = |d: usize| (d + 2 * conv.padding).saturating_sub(k) / conv.stride.max(1) + 1;
        self.moved_by(&stats, (n * out(h) * out(w)) as f64, mode)?;
        Ok(y)
    }

    /// Under [`BnMode::Train`], the running statistics moved by a batch's, of `count` values a
    /// channel.
    fn moved_by(&self, stats: &BatchStats, count: f64, mode: BnMode) -> candle_core::Result<()> {
        if mode == BnMode::Train {
            let device = self.running_mean.device();
            let mean = Tensor::new(stats.mean.as_slice(), device)?;
            let var = Tensor::new(stats.var.as_slice(), device)?;
            self.update_running(&mean, &var, count)?;
        }
        Ok(())
    }

    fn normalise(&self, x: &Tensor, mode: BnMode, relu: bool) -> candle_core::Result<Tensor> {
        let (_, c, _, _) = x.dims4()?;
        if mode.batch_statistics() {
            use ft_kernels::batch_norm::{batch_norm_relu_train, batch_norm_train};
            let op = if relu {
                batch_norm_relu_train
            } else {
                batch_norm_train
            };
            return self.with_batch_statistics(x, mode, op);
        }
        // With running statistics the normalisation is an affine map per channel: its scale
        // and shift are computed on [C] vectors, so the input's size is read once and written
        // twice (four maps of it and the ReLU's fifth as a chain over the whole input). The
        // weight and bias stay in the graph, so a gradient through an evaluation is still right.
        let shape = (1, c, 1, 1);
        let (scale, shift) = self.running_affine()?;
        let y = x
            .broadcast_mul(&scale.reshape(shape)?)?
            .broadcast_add(&shift.reshape(shape)?)?;
        if relu {
            ft_kernels::activation::relu(&y)
        } else {
            Ok(y)
        }
    }

    /// The running statistics' per-channel scale and shift: `y = x * scale + shift`.
    fn running_affine(&self) -> candle_core::Result<(Tensor, Tensor)> {
        let scale = (&self.weight / (self.running_var.as_tensor() + self.eps)?.sqrt()?)?;
        let shift = (&self.bias - (self.running_mean.as_tensor() * &scale)?)?;
        Ok((scale, shift))
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Evaluation as a per-channel scale and shift gives PyTorch's formula
    /// `(x - mean) / sqrt(var + eps) * weight + bias` (and its ReLU), and the weight still gets a
    /// gradient through it.
    #[test]
    fn evaluation_is_the_running_statistics_formula() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let c = 3;
        let var = |v: &[f64]| Var::from_slice(v, c, &dev);
        let (w, b) = (var(&[1.5, -0.5, 2.0])?, var(&[0.1, 0.2, -0.3])?);
        let bn = BatchNorm2d {
            weight: w.as_tensor().clone(),
            bias: b.as_tensor().clone(),
            running_mean: var(&[0.3, -1.0, 2.0])?,
            running_var: var(&[0.5, 2.0, 0.01])?,
            eps: 1e-5,
            momentum: 0.1,
        };
        let x = Tensor::randn(0f64, 2., (2, c, 4, 5), &dev)?;
        let shape = (1, c, 1, 1);
        let want = x
            .broadcast_sub(&bn.running_mean.as_tensor().reshape(shape)?)?
            .broadcast_div(
                &(bn.running_var.as_tensor() + 1e-5)?
                    .sqrt()?
                    .reshape(shape)?,
            )?
            .broadcast_mul(&w.as_tensor().reshape(shape)?)?
            .broadcast_add(&b.as_tensor().reshape(shape)?)?;
        let diff = |a: &Tensor, b: &Tensor| -> anyhow::Result<f64> {
            Ok((a - b)?.abs()?.max_all()?.to_scalar::<f64>()?)
        };
        assert!(diff(&bn.forward(&x, BnMode::Eval)?, &want)? < 1e-12);
        assert!(diff(&bn.forward_relu(&x, BnMode::Eval)?, &want.relu()?)? < 1e-12);
        let y = bn.forward(&x, BnMode::Eval)?;
        let g = y.sum_all()?.backward()?;
        let gw = g.get(w.as_tensor()).expect("weight gradient");
        assert_eq!(gw.dtype(), DType::F64);
        assert!(gw.abs()?.sum_all()?.to_scalar::<f64>()? > 0.0);
        Ok(())
    }

    /// A convolution and its batch norm as one op (`forward_conv`) move the running statistics
    /// as the convolution and then the batch norm do: the same batch statistics, counted over
    /// the convolution's output positions (a strided, padded convolution and a 1x1 one, every
    /// tail; a wrong count moves the unbiased running variance).
    #[test]
    fn conv_then_batch_norm_moves_the_running_statistics_as_the_separate_layers(
    ) -> anyhow::Result<()> {
        use crate::layers::Conv2d;
        let dev = Device::Cpu;
        let pool = MaxPool::square(3, 2, 1);
        for (k, stride, pad) in [(3, 2, 1), (1, 1, 0), (7, 2, 3)] {
            for tail in [BnTail::Plain, BnTail::Relu, BnTail::ReluMaxPool(pool)] {
                let layers = || -> anyhow::Result<(Conv2d, BatchNorm2d)> {
                    let pb = ParamBuilder::new(ft_params::ParamStore::new(), DType::F32, &dev, 7);
                    let conv = Conv2d::with_init(
                        &pb.pp("c"),
                        3,
                        4,
                        k,
                        stride,
                        pad,
                        true,
                        Init::Normal { std: 0.3 },
                    )?;
                    Ok((conv, BatchNorm2d::new(&pb.pp("bn"), 4)?))
                };
                let (conv, fused) = layers()?;
                let (_, separate) = layers()?;
                let x = Tensor::randn(0f32, 1., (5, 3, 11, 9), &dev)?;
                let y = fused.forward_conv(&conv, &x, BnMode::Train, tail)?;
                let z = conv.forward(&x)?;
                let want = match tail {
                    BnTail::Plain => separate.forward(&z, BnMode::Train)?,
                    BnTail::Relu => separate.forward_relu(&z, BnMode::Train)?,
                    BnTail::ReluMaxPool(p) => {
                        separate.forward_relu_max_pool(&z, BnMode::Train, p)?
                    }
                };
                let values =
                    |t: &Tensor| -> anyhow::Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1()?) };
                let case = format!("k {k} stride {stride} pad {pad} {tail:?}");
                assert_eq!(values(&y)?, values(&want)?, "{case}: output");
                for (a, b) in [
                    (&fused.running_mean, &separate.running_mean),
                    (&fused.running_var, &separate.running_var),
                ] {
                    assert_eq!(
                        values(a.as_tensor())?,
                        values(b.as_tensor())?,
                        "{case}: running statistics"
                    );
                }
                assert!(
                    values(fused.running_var.as_tensor())?
                        .iter()
                        .all(|v| *v != 1.0),
                    "{case}: not moved"
                );
            }
        }
        Ok(())
    }
}
