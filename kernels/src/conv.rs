//! 2-D convolution as im2col + one matrix product, with a backward of two matrix products and a
//! col2im, and nothing saved but the op's inputs.
//!
//! candle 0.11.1's CPU conv2d backward takes its direct (per-output dot product) route for the
//! input gradient and costs 6-7x its own forward (`cargo run -p ft-kernels --example conv_bench`),
//! which made it most of a UNet step on CPU. Here the forward unfolds
//! the input into columns [B, Ho*Wo, C*k*k] and multiplies once by the [O, C*k*k] weight; the
//! backward unfolds again (the columns are recomputed, not kept: they are k*k times the input) for
//! the weight gradient and folds the column gradient back for the input gradient. Other devices
//! use candle's conv2d (cuDNN or its im2col kernel on CUDA).

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

use crate::cpu;

/// Geometry of one convolution: square kernel, equal stride and padding on both axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    b: usize,
    c: usize,
    h: usize,
    w: usize,
    k: usize,
    stride: usize,
    pad: usize,
}

impl Geometry {
    fn new(dims: &[usize], k: usize, stride: usize, pad: usize) -> Result<Self> {
        let [b, c, h, w] = dims else {
            candle_core::bail!("conv2d expects [N, C, H, W], got {dims:?}");
        };
        if k == 0 || stride == 0 || h + 2 * pad < k || w + 2 * pad < k {
            candle_core::bail!(
                "conv2d: kernel {k} stride {stride} padding {pad} do not fit input {h}x{w}"
            );
        }
        Ok(Geometry {
            b: *b,
            c: *c,
            h: *h,
            w: *w,
            k,
            stride,
            pad,
        })
    }

    fn out_hw(&self) -> (usize, usize) {
        (
            (self.h + 2 * self.pad - self.k) / self.stride + 1,
            (self.w + 2 * self.pad - self.k) / self.stride + 1,
        )
    }

    /// Columns per image (output positions) and column length (C k k).
    fn cols(&self) -> (usize, usize) {
        let (oh, ow) = self.out_hw();
        (oh * ow, self.c * self.k * self.k)
    }

    /// Calls `f(column index within the image, offset in the column, input offset)` for every
    /// in-bounds (output position, kernel tap) pair of image `bi`.
    fn for_each_tap(&self, bi: usize, mut f: impl FnMut(usize, usize, usize)) {
        let (oh, ow) = self.out_hw();
        let (k, s, p) = (self.k, self.stride, self.pad as isize);
        for ci in 0..self.c {
            let plane = (bi * self.c + ci) * self.h * self.w;
            for ky in 0..k {
                for kx in 0..k {
                    let j = (ci * k + ky) * k + kx;
                    for oy in 0..oh {
                        let y = (oy * s) as isize + ky as isize - p;
                        if y < 0 || y >= self.h as isize {
                            continue;
                        }
                        let row = plane + y as usize * self.w;
                        for ox in 0..ow {
                            let x = (ox * s) as isize + kx as isize - p;
                            if x < 0 || x >= self.w as isize {
                                continue;
                            }
                            f(oy * ow + ox, j, row + x as usize);
                        }
                    }
                }
            }
        }
    }

    /// [B, C, H, W] (contiguous) to [B, Ho*Wo, C*k*k], zeros where the kernel hangs over the edge.
    fn im2col<T: WithDType>(&self, x: &[T]) -> Vec<T> {
        let (l, ck) = self.cols();
        let mut out = vec![T::zero(); self.b * l * ck];
        for bi in 0..self.b {
            let o = &mut out[bi * l * ck..(bi + 1) * l * ck];
            self.for_each_tap(bi, |col, j, src| o[col * ck + j] = x[src]);
        }
        out
    }

    /// The adjoint of `im2col`: sums every column entry back into the input position it came from.
    fn col2im(&self, cols: &[f64]) -> Vec<f64> {
        let (l, ck) = self.cols();
        let mut out = vec![0f64; self.b * self.c * self.h * self.w];
        for bi in 0..self.b {
            let cb = &cols[bi * l * ck..(bi + 1) * l * ck];
            self.for_each_tap(bi, |col, j, dst| out[dst] += cb[col * ck + j]);
        }
        out
    }
}

/// The columns of `x` as a tensor [B, Ho*Wo, C*k*k] (CPU, no gradient).
fn unfold(x: &Tensor, g: &Geometry) -> Result<Tensor> {
    let x = x.detach().contiguous()?;
    let (l, ck) = g.cols();
    fn run<T: WithDType>(x: &Tensor, g: &Geometry, l: usize, ck: usize) -> Result<Tensor> {
        let v: Vec<T> = x.flatten_all()?.to_vec1()?;
        Tensor::from_vec(g.im2col(&v), (g.b, l, ck), x.device())
    }
    match x.dtype() {
        DType::F32 => run::<f32>(&x, g, l, ck),
        DType::F64 => run::<f64>(&x, g, l, ck),
        DType::BF16 => run::<half::bf16>(&x, g, l, ck),
        DType::F16 => run::<half::f16>(&x, g, l, ck),
        d => candle_core::bail!("conv2d: unsupported dtype {d:?}"),
    }
}

#[derive(Debug, Clone, Copy)]
struct Conv2d {
    stride: usize,
    pad: usize,
}

impl Conv2d {
    fn geometry(&self, x: &[usize], w: &[usize]) -> Result<(Geometry, usize)> {
        let [o, c, kh, kw] = w else {
            candle_core::bail!("conv2d weight must be [O, C, k, k], got {w:?}");
        };
        if kh != kw || x.get(1) != Some(c) {
            candle_core::bail!("conv2d: weight {w:?} does not fit input {x:?}");
        }
        Ok((Geometry::new(x, *kh, self.stride, self.pad)?, *o))
    }
}

impl CustomOp2 for Conv2d {
    fn name(&self) -> &'static str {
        "ft-conv2d"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, o) = self.geometry(l1.dims(), l2.dims())?;
        let (oh, ow) = g.out_hw();
        let (l, ck) = g.cols();
        fn run<T: WithDType>(
            x: &[T],
            w: &[T],
            g: &Geometry,
            o: usize,
            l: usize,
            ck: usize,
        ) -> Result<Vec<T>> {
            let dev = candle_core::Device::Cpu;
            let cols = Tensor::from_vec(g.im2col(x), (g.b, l, ck), &dev)?;
            let w = Tensor::from_slice(w, (o, ck), &dev)?;
            // [B, L, CK] x [CK, O] as one 2-D product, then [B, O, L].
            let y = cols.reshape((g.b * l, ck))?.matmul(&w.t()?.contiguous()?)?;
            y.reshape((g.b, l, o))?
                .transpose(1, 2)?
                .contiguous()?
                .flatten_all()?
                .to_vec1()
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => {
                CpuStorage::F32(run(cpu::slice(x, l1)?, cpu::slice(w, l2)?, &g, o, l, ck)?)
            }
            (CpuStorage::F64(x), CpuStorage::F64(w)) => {
                CpuStorage::F64(run(cpu::slice(x, l1)?, cpu::slice(w, l2)?, &g, o, l, ck)?)
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w)) => {
                CpuStorage::BF16(run(cpu::slice(x, l1)?, cpu::slice(w, l2)?, &g, o, l, ck)?)
            }
            (CpuStorage::F16(x), CpuStorage::F16(w)) => {
                CpuStorage::F16(run(cpu::slice(x, l1)?, cpu::slice(w, l2)?, &g, o, l, ck)?)
            }
            _ => candle_core::bail!("conv2d: input and weight need the same float dtype"),
        };
        Ok((out, Shape::from((g.b, o, oh, ow))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (g, o) = self.geometry(x.dims(), w.dims())?;
        let (l, ck) = g.cols();
        // dY as [B, L, O]
        let dy = dy
            .detach()
            .reshape((g.b, o, l))?
            .transpose(1, 2)?
            .contiguous()?;
        let w2 = w.detach().reshape((o, ck))?.contiguous()?;
        // dW = sum_b dY_b^T cols_b, as one product over all images: [O, B L] x [B L, CK].
        let cols = unfold(x, &g)?.reshape((g.b * l, ck))?;
        let dyf = dy.reshape((g.b * l, o))?;
        let dw = dyf.t()?.contiguous()?.matmul(&cols)?;
        drop(cols);
        // dCols = dY W, folded back onto the input.
        let dcols: Vec<f64> = dyf
            .matmul(&w2)?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1()?;
        let dx = Tensor::from_vec(g.col2im(&dcols), x.shape(), x.device())?.to_dtype(x.dtype())?;
        Ok((Some(dx), Some(dw.reshape(w.shape())?)))
    }
}

/// `conv2d(x, weight) + bias` for x [N, C, H, W], weight [O, C, k, k], bias [O], with equal
/// stride and padding on both axes (what every model in this workspace uses).
pub fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: usize,
    padding: usize,
) -> Result<Tensor> {
    let y = if x.device().is_cpu() {
        x.contiguous()?.apply_op2(
            &weight.contiguous()?,
            Conv2d {
                stride,
                pad: padding,
            },
        )
    } else {
        x.conv2d(weight, padding, stride, 1, 1)
    };
    let y = y?;
    match bias {
        Some(b) => y.broadcast_add(&b.reshape((1, (), 1, 1))?),
        None => Ok(y),
    }
}
