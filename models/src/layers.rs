//! The small layers every model here is made of (linear, conv2d, layer and group norm), built
//! from the ops with a tested backward, with PyTorch's default initialisation unless told.

use candle_core::Tensor;
use ft_kernels::activation::{silu, Activation};
use ft_kernels::{linear, norm};
use ft_params::{Init, ParamBuilder};

use crate::error::Result;

/// `torch.nn.Linear`: `weight` [out, in], optional `bias`.
#[derive(Clone)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    /// PyTorch's default: weight and bias U(-1/sqrt(in), 1/sqrt(in)).
    pub fn new(pb: &ParamBuilder, din: usize, dout: usize, bias: bool) -> Result<Self> {
        let bound = 1.0 / (din as f64).sqrt();
        Self::with_init(pb, din, dout, bias, Init::Uniform { bound })
    }

    /// `weight_init` for the weight; the bias (when any) starts at zero.
    pub fn with_init(
        pb: &ParamBuilder,
        din: usize,
        dout: usize,
        bias: bool,
        weight_init: Init,
    ) -> Result<Self> {
        let weight = pb.get(&[dout, din], "weight", weight_init)?;
        let bias = if bias {
            let init = match weight_init {
                Init::Uniform { .. } => weight_init,
                _ => Init::Zeros,
            };
            Some(pb.get(&[dout], "bias", init)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        linear::linear(x, &self.weight, self.bias.as_ref())
    }

    /// The parameters, for checkpoint segments.
    pub fn tensors(&self) -> Vec<Tensor> {
        let mut v = vec![self.weight.clone()];
        v.extend(self.bias.clone());
        v
    }
}

/// `torch.nn.Conv2d` with square kernels, `weight` [out, in, k, k] and optional `bias`.
#[derive(Clone)]
pub struct Conv2d {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub stride: usize,
    pub padding: usize,
}

impl Conv2d {
    /// PyTorch's default: weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    pub fn new(
        pb: &ParamBuilder,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        padding: usize,
    ) -> Result<Self> {
        let bound = 1.0 / ((cin * k * k) as f64).sqrt();
        Self::with_init(
            pb,
            cin,
            cout,
            k,
            stride,
            padding,
            true,
            Init::Uniform { bound },
        )
    }

    /// `weight_init` for the weight; a bias (when any) is U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    #[allow(clippy::too_many_arguments)]
    pub fn with_init(
        pb: &ParamBuilder,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        padding: usize,
        bias: bool,
        weight_init: Init,
    ) -> Result<Self> {
        let bound = 1.0 / ((cin * k * k) as f64).sqrt();
        Ok(Conv2d {
            weight: pb.get(&[cout, cin, k, k], "weight", weight_init)?,
            bias: if bias {
                Some(pb.get(&[cout], "bias", Init::Uniform { bound })?)
            } else {
                None
            },
            stride,
            padding,
        })
    }

    /// Through `ft_kernels::conv` (im2col + matmul with its own backward, 2.5-3x faster than
    /// candle's CPU conv2d forward + backward: `cargo run -p ft-kernels --example conv_bench`).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        ft_kernels::conv::conv2d(
            x,
            &self.weight,
            self.bias.as_ref(),
            self.stride,
            self.padding,
        )
    }

    /// `self.forward(x) + shift[:, :, None, None]` for `shift` [N, O] (a UNet block's time
    /// embedding): the shift and the bias summed first ([N, O]) and added by the convolution
    /// (`ft_kernels::conv::conv2d`'s per-image bias), so the graph keeps one map of the output's
    /// size rather than two. The sum rounds `conv + (bias + shift)` where PyTorch rounds
    /// `(conv + bias) + shift`.
    pub fn forward_shifted(&self, x: &Tensor, shift: &Tensor) -> candle_core::Result<Tensor> {
        let bias = match &self.bias {
            Some(b) => shift.broadcast_add(b)?,
            None => shift.clone(),
        };
        ft_kernels::conv::conv2d(x, &self.weight, Some(&bias), self.stride, self.padding)
    }

    pub fn tensors(&self) -> Vec<Tensor> {
        let mut v = vec![self.weight.clone()];
        v.extend(self.bias.clone());
        v
    }
}

/// Layer norm over the last dimension, or group norm over [N, C, *], with affine parameters.
#[derive(Clone)]
pub struct Norm {
    pub weight: Tensor,
    pub bias: Tensor,
    groups: Option<usize>,
    eps: f64,
}

impl Norm {
    pub fn layer(pb: &ParamBuilder, dim: usize, eps: f64) -> Result<Self> {
        Ok(Norm {
            weight: pb.get(&[dim], "weight", Init::Ones)?,
            bias: pb.get(&[dim], "bias", Init::Zeros)?,
            groups: None,
            eps,
        })
    }

    pub fn group(pb: &ParamBuilder, channels: usize, groups: usize, eps: f64) -> Result<Self> {
        Ok(Norm {
            weight: pb.get(&[channels], "weight", Init::Ones)?,
            bias: pb.get(&[channels], "bias", Init::Zeros)?,
            groups: Some(groups),
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.groups {
            Some(g) => norm::group_norm(x, g, Some(&self.weight), Some(&self.bias), self.eps),
            None => norm::layer_norm(x, Some(&self.weight), Some(&self.bias), self.eps),
        }
    }

    /// `silu(self.forward(x))` (every UNet and VAE ResNet block's), one op for a group norm
    /// (`norm::group_norm_act`): the graph keeps `x` alone, not the normalised, scaled and
    /// shifted values.
    pub fn forward_silu(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.groups {
            Some(g) => norm::group_norm_act(
                x,
                g,
                Some(&self.weight),
                Some(&self.bias),
                self.eps,
                Activation::Silu,
            ),
            None => silu(&self.forward(x)?),
        }
    }

    pub fn tensors(&self) -> Vec<Tensor> {
        vec![self.weight.clone(), self.bias.clone()]
    }
}
