//! 2-D convolution as im2col + matrix products, with a backward of two matrix products and a
//! col2im, and nothing saved but the op's inputs.
//!
//! candle 0.11.1's CPU conv2d backward takes its direct (per-output dot product) route for the
//! input gradient and costs 6-7x its own forward (`cargo run -p ft-kernels --example conv_bench`),
//! which made it most of a UNet step on CPU. Here, in f32 and f64 ([`by_image`]), each image is
//! unfolded into columns [C k k, Ho Wo] (a buffer of one image, reused for the next) and
//! multiplied by the [O, C k k] weight straight into its [O, Ho Wo] output; the backward unfolds
//! again (the columns are recomputed, not kept: they are k*k times the input), sums the
//! weight gradient over the images in order (in parts of its columns, below) and folds each
//! image's column gradient back (summed in f64). Images with few output positions (a deep layer's) are
//! multiplied a group at a time, side by side in one product of at least 256 columns (ResNet's
//! last stage at 84 px has 9 per image), and an input outside the graph (the images a network's
//! first layer reads) gets no input gradient. Where there are several groups and their products
//! are small or medium (up to `TASK_MACS` multiply-adds: every layer of an FSCT episode), the
//! groups go on rayon's threads, one each with its product on one thread, for the forward and
//! the input gradient: on two cores gemm's own threads ran such products at half the speed of
//! one thread each. A lone large image is unfolded and folded over rayon's threads and
//! multiplied in blocks, one a thread (`crate::gemm_blocks`). The weight gradient is computed in up to eight parts of its columns
//! fixed by the shape (each part unfolding only its rows), on rayon's threads, each summing the
//! groups in order: no result depends on the threads. Nothing of the size of all the images' columns is ever made (at 84 px, Conv4's second
//! layer: 345 MB of columns, and as many again of their gradient in f64 twice over, each a fresh
//! allocation the kernel zeroed page by page). bf16 and f16 unfold all images ([`geometry`])
//! and take candle's matmul. Other devices use candle's conv2d (cuDNN or its im2col kernel on
//! CUDA).

use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

use crate::{cpu, grad_tap};

mod by_image;
mod geometry;
mod with_batch_norm;

pub use with_batch_norm::{BnTail, ConvBatchNorm};

use by_image::{backward_tensors, forward_storage};
use geometry::Geometry;

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
        if let Some(out) = forward_storage((s1, l1), (s2, l2), None, &g, o)? {
            return Ok((out, Shape::from((g.b, o, oh, ow))));
        }
        let out = match (s1, s2) {
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
        if matches!(x.dtype(), DType::F32 | DType::F64) {
            let (dx, dw, _) = backward_tensors(x, w, None, dy, &g, o)?;
            return Ok((dx, grad_tap::hand_over(w, Some(dw))?));
        }
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

/// The convolution with its bias added in the same op (CPU, f32 and f64): no second map of the
/// output's size, and the bias gradient summed from the output gradient the backward reads
/// anyway (as a broadcast add, candle summed it over three non-last dimensions on one thread).
#[derive(Debug, Clone, Copy)]
struct Conv2dBias(Conv2d);

impl CustomOp3 for Conv2dBias {
    fn name(&self) -> &'static str {
        "ft-conv2d-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, o) = self.0.geometry(l1.dims(), l2.dims())?;
        if l3.dims() != [o] && l3.dims() != [g.b, o] {
            candle_core::bail!(
                "conv2d: a bias of {:?} for {} images of {o} channels",
                l3.dims(),
                g.b
            );
        }
        let (oh, ow) = g.out_hw();
        let Some(out) = forward_storage((s1, l1), (s2, l2), Some((s3, l3)), &g, o)? else {
            candle_core::bail!("conv2d with bias: f32 or f64, the same for all three")
        };
        Ok((out, Shape::from((g.b, o, oh, ow))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (g, o) = self.0.geometry(x.dims(), w.dims())?;
        let (dx, dw, db) = backward_tensors(x, w, Some(b), dy, &g, o)?;
        Ok((
            dx,
            grad_tap::hand_over(w, Some(dw))?,
            grad_tap::hand_over(b, db)?,
        ))
    }
}

/// Whether `conv2d` adds a bias inside the convolution op (the CPU in f32 and f64) rather than
/// as a broadcast add after it: the activation formulas count one map less then.
pub fn bias_in_op(device: &candle_core::Device, dtype: DType) -> bool {
    device.is_cpu() && matches!(dtype, DType::F32 | DType::F64)
}

/// `conv2d(x, weight) + bias` for x [N, C, H, W], weight [O, C, k, k], bias [O] or [N, O] (each
/// image's own: a UNet block's convolution bias plus its time embedding, added in the op rather
/// than by a broadcast add that would keep a second map of the output's size), with equal stride
/// and padding on both axes (what every model in this workspace uses).
pub fn conv2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: usize,
    padding: usize,
) -> Result<Tensor> {
    let op = Conv2d {
        stride,
        pad: padding,
    };
    // A [1, O] bias is a channel's, whatever the batch (as a broadcast add would take it).
    let flat;
    let bias = match bias {
        Some(b) if b.rank() == 2 && b.dim(0)? == 1 => {
            flat = b.flatten_all()?;
            Some(&flat)
        }
        b => b,
    };
    if let Some(b) = bias {
        if bias_in_op(x.device(), x.dtype()) && b.dtype() == x.dtype() {
            return x.contiguous()?.apply_op3(
                &weight.contiguous()?,
                &b.contiguous()?,
                Conv2dBias(op),
            );
        }
    }
    let y = if x.device().is_cpu() {
        x.contiguous()?.apply_op2(&weight.contiguous()?, op)
    } else {
        x.conv2d(weight, padding, stride, 1, 1)
    };
    let y = y?;
    match bias {
        Some(b) if b.rank() == 2 => y.broadcast_add(&b.unsqueeze(2)?.unsqueeze(3)?),
        Some(b) => y.broadcast_add(&b.reshape((1, (), 1, 1))?),
        None => Ok(y),
    }
}
