//! Matrix products that never take candle's broken strided-broadcast route.
//!
//! candle 0.11.1 computes a wrong forward for a transposed-view lhs times a stride-0 broadcast
//! rhs with batch > 1 (what `nn::Linear` does on a non-contiguous 3-D input) and errors on a 4-D
//! non-contiguous rhs. Both operands here are made contiguous and batch dimensions are broadcast
//! explicitly before the product.

use candle_core::{Result, Tensor};

/// `a @ b` for 2-D to 4-D tensors with broadcast batch dimensions.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (ra, rb) = (a.rank(), b.rank());
    if ra < 2 || rb < 2 {
        candle_core::bail!(
            "matmul needs rank >= 2, got {:?} and {:?}",
            a.dims(),
            b.dims()
        );
    }
    let (ba, bb) = (&a.dims()[..ra - 2], &b.dims()[..rb - 2]);
    let batch = candle_core::Shape::from(ba).broadcast_shape_binary_op(&bb.into(), "matmul")?;
    let full = |t: &Tensor, r: usize| -> Result<Tensor> {
        let mut d = batch.dims().to_vec();
        d.extend_from_slice(&t.dims()[r - 2..]);
        if t.dims() == d.as_slice() {
            t.contiguous()
        } else {
            t.broadcast_as(d)?.contiguous()
        }
    };
    full(a, ra)?.matmul(&full(b, rb)?)
}

/// `x @ weight^T + bias` for `x` of any rank >= 1 and `weight` of shape [out, in].
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let inner = *dims.last().unwrap_or(&0);
    let rows = x.elem_count() / inner.max(1);
    let x2 = x.contiguous()?.reshape((rows, inner))?;
    let y = x2.matmul(&weight.t()?)?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out = dims;
    if let Some(last) = out.last_mut() {
        *last = weight.dim(0)?;
    }
    y.reshape(out)
}
