//! Max and average pooling over [N, C, H, W] with any kernel and stride, PyTorch's floor mode
//! (out = (H - k) / s + 1, no padding), and a correct backward.
//!
//! candle's `max_pool2d` backward scales the gradient by 1/k^2 and errors for kernel != stride;
//! its `avg_pool2d` is wrong for odd inputs. The forward here runs on the CPU storage; the
//! backward computes on the host (the gradient goes to the first maximum of each window, as in
//! PyTorch, or is spread evenly for average pooling) and is checked against finite differences.
//! On CUDA both passes are kernels (`crate::cuda`), tested against this CPU version.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use crate::cpu;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Max,
    Avg,
}

#[derive(Debug, Clone, Copy)]
struct Pool {
    kind: Kind,
    kernel: (usize, usize),
    stride: (usize, usize),
}

impl Pool {
    #[cfg(feature = "cuda")]
    fn spec(&self) -> crate::cuda::PoolSpec {
        crate::cuda::PoolSpec {
            kind: match self.kind {
                Kind::Max => 0,
                Kind::Avg => 1,
            },
            kernel: self.kernel,
            stride: self.stride,
        }
    }

    fn out_hw(&self, h: usize, w: usize) -> Result<(usize, usize)> {
        let (kh, kw) = self.kernel;
        let (sh, sw) = self.stride;
        if kh == 0 || kw == 0 || sh == 0 || sw == 0 || kh > h || kw > w {
            candle_core::bail!(
                "pool: kernel {:?} stride {:?} do not fit input {h}x{w}",
                self.kernel,
                self.stride
            );
        }
        Ok(((h - kh) / sh + 1, (w - kw) / sw + 1))
    }

    /// Forward on one [H, W] plane; `arg` receives the flat input index of each output's source
    /// (max) when given.
    fn plane(&self, x: &[f64], w: usize, out: &mut [f64], mut arg: Option<&mut [usize]>) {
        let (kh, kw) = self.kernel;
        let (sh, sw) = self.stride;
        let ow = (w - kw) / sw + 1;
        for (o, y) in out.iter_mut().enumerate() {
            let (oy, ox) = (o / ow, o % ow);
            let (mut best, mut best_at, mut sum) = (f64::NEG_INFINITY, 0usize, 0.0);
            for dy in 0..kh {
                for dx in 0..kw {
                    let idx = (oy * sh + dy) * w + ox * sw + dx;
                    let v = x[idx];
                    sum += v;
                    // First maximum wins ties, like PyTorch; NaN propagates.
                    if v > best || v.is_nan() && !best.is_nan() {
                        best = v;
                        best_at = idx;
                    }
                }
            }
            *y = match self.kind {
                Kind::Max => best,
                Kind::Avg => sum / (kh * kw) as f64,
            };
            if let Some(a) = arg.as_deref_mut() {
                a[o] = best_at;
            }
        }
    }

    fn forward_vec(&self, x: &[f64], dims: (usize, usize, usize, usize)) -> Result<Vec<f64>> {
        let (n, c, h, w) = dims;
        let (oh, ow) = self.out_hw(h, w)?;
        let mut out = vec![0f64; n * c * oh * ow];
        for (p, o) in out.chunks_mut(oh * ow).enumerate() {
            self.plane(&x[p * h * w..(p + 1) * h * w], w, o, None);
        }
        Ok(out)
    }

    fn backward_vec(
        &self,
        x: &[f64],
        g: &[f64],
        dims: (usize, usize, usize, usize),
    ) -> Result<Vec<f64>> {
        let (n, c, h, w) = dims;
        let (oh, ow) = self.out_hw(h, w)?;
        let (kh, kw) = self.kernel;
        let (sh, sw) = self.stride;
        let mut dx = vec![0f64; n * c * h * w];
        let mut out = vec![0f64; oh * ow];
        let mut arg = vec![0usize; oh * ow];
        for p in 0..n * c {
            let xp = &x[p * h * w..(p + 1) * h * w];
            let gp = &g[p * oh * ow..(p + 1) * oh * ow];
            let dxp = &mut dx[p * h * w..(p + 1) * h * w];
            match self.kind {
                Kind::Max => {
                    self.plane(xp, w, &mut out, Some(&mut arg));
                    for (o, &a) in arg.iter().enumerate() {
                        dxp[a] += gp[o];
                    }
                }
                Kind::Avg => {
                    let share = 1.0 / (kh * kw) as f64;
                    for (o, &go) in gp.iter().enumerate() {
                        let (oy, ox) = (o / ow, o % ow);
                        for dy in 0..kh {
                            for dxx in 0..kw {
                                dxp[(oy * sh + dy) * w + ox * sw + dxx] += go * share;
                            }
                        }
                    }
                }
            }
        }
        Ok(dx)
    }
}

fn to_f64_vec(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()
}

impl CustomOp1 for Pool {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Max => "ft-max-pool2d",
            Kind::Avg => "ft-avg-pool2d",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = match l.dims() {
            [n, c, h, w] => (*n, *c, *h, *w),
            d => candle_core::bail!("pool expects [N, C, H, W], got {d:?}"),
        };
        let (oh, ow) = self.out_hw(dims.2, dims.3)?;
        fn run<T: candle_core::WithDType>(
            p: &Pool,
            d: &[T],
            l: &Layout,
            dims: (usize, usize, usize, usize),
        ) -> Result<Vec<T>> {
            let x: Vec<f64> = cpu::slice(d, l)?.iter().map(|v| v.to_f64()).collect();
            Ok(p.forward_vec(&x, dims)?
                .into_iter()
                .map(T::from_f64)
                .collect())
        }
        let out = match s {
            CpuStorage::F32(d) => CpuStorage::F32(run(self, d, l, dims)?),
            CpuStorage::F64(d) => CpuStorage::F64(run(self, d, l, dims)?),
            CpuStorage::F16(d) => CpuStorage::F16(run(self, d, l, dims)?),
            CpuStorage::BF16(d) => CpuStorage::BF16(run(self, d, l, dims)?),
            _ => candle_core::bail!("pool: unsupported dtype"),
        };
        Ok((out, Shape::from((dims.0, dims.1, oh, ow))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, c, h, w) = match l.dims() {
            [n, c, h, w] => (*n, *c, *h, *w),
            d => candle_core::bail!("pool expects [N, C, H, W], got {d:?}"),
        };
        let (oh, ow) = self.out_hw(h, w)?;
        let out = crate::cuda::pool_forward(s, l, self.spec(), (oh, ow))?;
        Ok((out, Shape::from((n, c, oh, ow))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if arg.device().is_cuda() {
            return Ok(Some(crate::cuda::pool_backward(arg, g, self.spec())?));
        }
        let dims = arg.dims4()?;
        let dx = self.backward_vec(&to_f64_vec(arg)?, &to_f64_vec(g)?, dims)?;
        Ok(Some(
            Tensor::from_vec(dx, arg.shape(), arg.device())?.to_dtype(arg.dtype())?,
        ))
    }
}

fn pool(x: &Tensor, kind: Kind, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor> {
    if !crate::has_kernel(x) {
        candle_core::bail!(
            "pooling runs on the CPU or CUDA (f32, bf16, f16); got {:?} on {:?}",
            x.dtype(),
            x.device()
        );
    }
    x.contiguous()?.apply_op1(Pool {
        kind,
        kernel,
        stride,
    })
}

/// Max pooling; the gradient goes to the first maximum of each window.
pub fn max_pool2d(x: &Tensor, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor> {
    pool(x, Kind::Max, kernel, stride)
}

/// Average pooling (no padding, so every window has k*k elements).
pub fn avg_pool2d(x: &Tensor, kernel: (usize, usize), stride: (usize, usize)) -> Result<Tensor> {
    pool(x, Kind::Avg, kernel, stride)
}

/// Global average pooling [N, C, H, W] -> [N, C] (a mean, whose backward candle gets right).
pub fn global_avg_pool(x: &Tensor) -> Result<Tensor> {
    x.flatten_from(2)?.mean(2)
}
