//! Layer, RMS and group normalisation with a backward.
//!
//! candle's fast `layer_norm`/`rms_norm` (and `nn::LayerNorm`/`nn::RmsNorm` on contiguous input)
//! have no backward at all. With a weight (as every model here has one) the normalisation, its
//! affine part and, for [`group_norm_act`], the activation after it are one op on the CPU and
//! on CUDA with the own kernels (`norm_affine`: the graph keeps only the input). Elsewhere, and without a weight,
//! the normalisation is one op that keeps only its input and output (its backward recomputes
//! the row statistics) and the affine part a plain broadcast multiply/add, whose backward
//! candle gets right.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};

use crate::activation::{activate, Activation};
use crate::cpu;
use crate::norm_affine::{self, Spec};

/// Normalises rows: `(x - mean) * rsqrt(var + eps)` (layer norm) or `x * rsqrt(mean(x^2) + eps)`.
struct Normalize {
    eps: f64,
    center: bool,
}

impl Normalize {
    fn row(&self, x: &[f64], y: &mut [f64]) {
        let (mean, r) = cpu::row_stats(x, self.center, self.eps);
        for (yi, xi) in y.iter_mut().zip(x) {
            *yi = (xi - mean) * r;
        }
    }

    /// `r`, the per-row reciprocal std, recomputed from the input in f32 (f64 for f64).
    fn rstd(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let xc = if self.center {
            x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?
        } else {
            x.clone()
        };
        let r = (xc.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?;
        Ok((xc, r))
    }
}

impl CustomOp1 for Normalize {
    fn name(&self) -> &'static str {
        if self.center {
            "ft-layer-normalize"
        } else {
            "ft-rms-normalize"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((cpu::rows(s, l, &|x, y| self.row(x, y))?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            crate::cuda::norm_forward(s, l, self.eps, self.center)?,
            l.shape().clone(),
        ))
    }

    /// dx = r * (g - mean(g) - xhat * mean(g * xhat)) for layer norm, without the `mean(g)` term
    /// for RMS norm; computed in f32 (f64 for f64 inputs).
    fn bwd(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if arg.device().is_cuda() {
            return Ok(Some(crate::cuda::norm_backward(
                arg,
                g,
                self.eps,
                self.center,
            )?));
        }
        let dt = arg.dtype();
        let wide = if dt == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let x = arg.to_dtype(wide)?;
        let g = g.to_dtype(wide)?;
        let (xc, r) = self.rstd(&x)?;
        let xhat = xc.broadcast_mul(&r)?;
        let mut inner =
            g.broadcast_sub(&xhat.broadcast_mul(&(&g * &xhat)?.mean_keepdim(D::Minus1)?)?)?;
        if self.center {
            inner = inner.broadcast_sub(&g.mean_keepdim(D::Minus1)?)?;
        }
        Ok(Some(inner.broadcast_mul(&r)?.to_dtype(dt)?))
    }
}

fn normalize(x: &Tensor, eps: f64, center: bool) -> Result<Tensor> {
    let op = Normalize { eps, center };
    if crate::has_kernel(x) {
        x.contiguous()?.apply_op1(op)
    } else {
        let dt = x.dtype();
        let wide = if dt == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let (xc, r) = op.rstd(&x.to_dtype(wide)?)?;
        xc.broadcast_mul(&r)?.to_dtype(dt)
    }
}

fn affine(y: Tensor, weight: Option<&Tensor>, bias: Option<&Tensor>) -> Result<Tensor> {
    let y = match weight {
        Some(w) => y.broadcast_mul(w)?,
        None => y,
    };
    match bias {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// Layer norm over the last dimension, as `torch.nn.functional.layer_norm`.
pub fn layer_norm(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    if let (Some(w), true) = (weight, norm_affine::takes(x)) {
        let spec = Spec {
            eps,
            center: true,
            groups: None,
            act: None,
        };
        return norm_affine::apply(x, w, bias, spec);
    }
    affine(normalize(x, eps, true)?, weight, bias)
}

/// RMS norm over the last dimension (T5's LayerNorm): `x * rsqrt(mean(x^2) + eps) * weight`,
/// with the statistics computed in f64 on CPU (f32 on other devices) for low-precision inputs.
pub fn rms_norm(x: &Tensor, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    if let (Some(w), true) = (weight, norm_affine::takes(x)) {
        let spec = Spec {
            eps,
            center: false,
            groups: None,
            act: None,
        };
        return norm_affine::apply(x, w, None, spec);
    }
    affine(normalize(x, eps, false)?, weight, None)
}

/// Group norm of `[N, C, *]` over `num_groups` groups of channels, as
/// `torch.nn.functional.group_norm` (per-channel weight and bias).
pub fn group_norm(
    x: &Tensor,
    num_groups: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    grouped(x, num_groups, (weight, bias), eps, None)
}

/// [`group_norm`] followed by `act` (the UNet's and VAE's `silu(norm(x))`), one op with a
/// weight: the graph keeps the input alone, not the normalised, scaled, shifted values.
pub fn group_norm_act(
    x: &Tensor,
    num_groups: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
    act: Activation,
) -> Result<Tensor> {
    grouped(x, num_groups, (weight, bias), eps, Some(act))
}

fn grouped(
    x: &Tensor,
    num_groups: usize,
    (weight, bias): (Option<&Tensor>, Option<&Tensor>),
    eps: f64,
    act: Option<Activation>,
) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    if dims.len() < 2 || num_groups == 0 || !dims[1].is_multiple_of(num_groups) {
        candle_core::bail!(
            "group_norm: {num_groups} groups do not divide the channels of {dims:?}"
        );
    }
    if let (Some(w), true) = (weight, norm_affine::takes(x)) {
        let spec = Spec {
            eps,
            center: true,
            groups: Some(num_groups),
            act,
        };
        return norm_affine::apply(x, w, bias, spec);
    }
    let n = dims[0];
    let y = normalize(&x.reshape((n, num_groups, ()))?, eps, true)?.reshape(dims.as_slice())?;
    let mut shape = vec![1usize; dims.len()];
    shape[1] = dims[1];
    let w = weight.map(|w| w.reshape(shape.as_slice())).transpose()?;
    let b = bias.map(|b| b.reshape(shape.as_slice())).transpose()?;
    let y = affine(y, w.as_ref(), b.as_ref())?;
    match act {
        Some(a) => activate(&y, a),
        None => Ok(y),
    }
}
