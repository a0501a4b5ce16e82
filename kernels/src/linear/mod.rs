//! Matrix products that never take candle's broken strided-broadcast route, and linear layers
//! as one op on the CPU.
//!
//! candle 0.11.1 computes a wrong forward for a transposed-view lhs times a stride-0 broadcast
//! rhs with batch > 1 (what `nn::Linear` does on a non-contiguous 3-D input) and errors on a 4-D
//! non-contiguous rhs. Both operands here are made contiguous and batch dimensions are broadcast
//! explicitly before the product. A linear layer on the CPU in f32 or f64 is one op ([`op`]);
//! elsewhere (bf16, CUDA) it is candle's matmul and bias add. `FT_LINEAR_OP=0` runs candle's
//! ops on the CPU too.

mod op;

use candle_core::{DType, Result, Tensor};

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

/// Whether the one-op linear layer runs (`FT_LINEAR_OP=0` turns it off), read once.
fn op_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switched_on(&ON, "FT_LINEAR_OP")
}

/// Whether `linear(x, weight, bias)` runs as one op: on the CPU, everything f32 or everything
/// f64, a contiguous [out, in] weight and [out] bias, the op switched on. (The memory plans
/// count the op wherever these hold, also under `FT_LINEAR_OP=0`: the switch is for
/// measurements.)
pub fn is_one_op(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> bool {
    let dtype = x.dtype();
    op_enabled()
        && x.device().is_cpu()
        && matches!(dtype, DType::F32 | DType::F64)
        && weight.dtype() == dtype
        && weight.rank() == 2
        && weight.is_contiguous()
        && bias.is_none_or(|b| {
            b.dtype() == dtype && b.is_contiguous() && b.dims() == [weight.dims()[0]]
        })
}

/// `x @ weight^T + bias` for `x` of any rank >= 1 and `weight` of shape [out, in]: one op where
/// [`is_one_op`], candle's matmul and bias add elsewhere (an input that is a view is made
/// contiguous first either way).
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    if x.rank() >= 1 && is_one_op(x, weight, bias) {
        let x = x.contiguous()?;
        return match bias {
            Some(b) => x.apply_op3(weight, b, op::Linear),
            None => x.apply_op2(weight, op::Linear),
        };
    }
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
