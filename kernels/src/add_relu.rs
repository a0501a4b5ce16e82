//! `relu(a + b)` as one op: the join of a ResNet block, where the shortcut meets the block's
//! output.
//!
//! As candle's ops the sum is one map of the inputs' size, the ReLU another, both kept by the
//! graph, and the ReLU's backward makes five more (the zeros it accumulates into, zeros to
//! compare with, the `ge` mask, the mask as floats, the product) before the sum's backward
//! hands the result to both inputs. Here the forward writes `max(a + b, 0)` once and the backward
//! reads its output: `dy` where the output is positive, else 0 (PyTorch's ReLU backward; candle's
//! passes the gradient at exactly 0 too), one map given to both inputs. CPU, f32 and f64, in
//! chunks on rayon's threads; elsewhere candle's ops.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use crate::host;

/// The forward: `max(a + b, 0)`.
struct AddRelu;

/// `max(a + b, 0)` over two contiguous slices of one length.
fn forward<T: candle_core::WithDType + PartialOrd>(a: &[T], b: &[T]) -> Vec<T> {
    let mut out = vec![T::zero(); a.len()];
    host::par_chunks(&mut out, |at, c| {
        for (j, o) in c.iter_mut().enumerate() {
            let s = a[at + j] + b[at + j];
            *o = if s > T::zero() { s } else { T::zero() };
        }
    });
    out
}

/// `g` where `y > 0`, else 0.
fn backward<T: candle_core::WithDType + PartialOrd>(g: &[T], y: &[T]) -> Vec<T> {
    let mut out = vec![T::zero(); g.len()];
    host::par_chunks(&mut out, |at, c| {
        for (j, o) in c.iter_mut().enumerate() {
            if y[at + j] > T::zero() {
                *o = g[at + j];
            }
        }
    });
    out
}

/// The two operands as contiguous slices of one shape.
fn pair<'a, T: candle_core::WithDType>(
    what: &str,
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
) -> Result<(&'a [T], &'a [T])> {
    if l1.shape() != l2.shape() {
        bail!("{what}: shapes {:?} and {:?}", l1.dims(), l2.dims());
    }
    match (l1.contiguous_offsets(), l2.contiguous_offsets()) {
        (Some((a1, b1)), Some((a2, b2))) => {
            Ok((&s1.as_slice::<T>()?[a1..b1], &s2.as_slice::<T>()?[a2..b2]))
        }
        _ => bail!("{what}: the operands must be contiguous"),
    }
}

/// Runs `f` on the two operands' slices in their dtype (f32 or f64, the same).
fn on_pair(
    what: &str,
    x: (&CpuStorage, &Layout),
    y: (&CpuStorage, &Layout),
    f32s: impl Fn(&[f32], &[f32]) -> Vec<f32>,
    f64s: impl Fn(&[f64], &[f64]) -> Vec<f64>,
) -> Result<(CpuStorage, Shape)> {
    let out = match (x.0, y.0) {
        (CpuStorage::F32(_), CpuStorage::F32(_)) => {
            let (a, b) = pair::<f32>(what, x, y)?;
            CpuStorage::F32(f32s(a, b))
        }
        (CpuStorage::F64(_), CpuStorage::F64(_)) => {
            let (a, b) = pair::<f64>(what, x, y)?;
            CpuStorage::F64(f64s(a, b))
        }
        (a, b) => bail!(
            "{what}: {:?} and {:?} (f32 or f64, the same)",
            a.dtype(),
            b.dtype()
        ),
    };
    Ok((out, x.1.shape().clone()))
}

impl CustomOp2 for AddRelu {
    fn name(&self) -> &'static str {
        "ft-add-relu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        on_pair("add_relu", (s1, l1), (s2, l2), forward, forward)
    }

    fn bwd(
        &self,
        _a: &Tensor,
        _b: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = masked(g, y)?;
        Ok((Some(d.clone()), Some(d)))
    }
}

/// `g` where `y > 0`, else 0: the ReLU's backward from its output (the join's, and the fused
/// batch norm's in `crate::batch_norm_add`). CPU, f32 and f64, `g` and `y` of one shape.
pub(crate) fn masked(g: &Tensor, y: &Tensor) -> Result<Tensor> {
    g.contiguous()?
        .apply_op2_no_bwd(&y.contiguous()?, &Backward)
}

/// The backward: the gradient where the output is positive.
struct Backward;

impl CustomOp2 for Backward {
    fn name(&self) -> &'static str {
        "ft-add-relu-backward"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        ys: &CpuStorage,
        yl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        on_pair("add_relu backward", (gs, gl), (ys, yl), backward, backward)
    }
}

/// `relu(a + b)` with its backward: one op on the CPU for f32 and f64 (see the module),
/// candle's ops elsewhere.
pub fn add_relu(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let ours = a.device().is_cpu()
        && a.dtype() == b.dtype()
        && matches!(a.dtype(), DType::F32 | DType::F64)
        && a.dims() == b.dims();
    if !ours {
        return (a + b)?.relu();
    }
    a.contiguous()?.apply_op2(&b.contiguous()?, AddRelu)
}
