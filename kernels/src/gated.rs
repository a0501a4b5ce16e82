//! `act(gate) * value` as one op: the gated feed-forward of T5 v1.1 and FLAN-T5
//! (`gelu_new(wi_0 x) * wi_1 x`, two projections) and diffusers' GEGLU (`value * gelu(gate)`, the
//! two halves of one projection).
//!
//! As two ops the graph keeps the activation's output for the product's backward, a tensor of
//! the feed-forward's width that nothing else reads: one `d_ff`-wide tensor a T5 layer, a
//! `4 d`-wide one a UNet transformer block. The backward then makes the product's two
//! gradients, the activation's, and under GEGLU each half's gradient padded with zeros to the
//! projection's width (candle's `narrow` backward) and the two added. Here the forward keeps
//! only its inputs (the projections, which their own backward holds anyway) and the backward is
//! one pass that writes both gradients: `g * act(gate)` for the value, `g * value * act'(gate)`
//! for the gate, into one tensor (under GEGLU the projection's gradient itself).
//!
//! Each value is rounded as the two ops round it (the activation, then the product; the
//! product's gradient, then the activation's), so on the CPU f32 gives the same bits as before
//! and bf16 and f16 the same values (tested). CPU: f32, f64, bf16 and f16, on the calling thread below
//! [`host::CHUNK`] elements and in chunks on rayon's threads above, each loop compiled for the
//! CPU's widest vector unit ([`crate::wide`]; the same bits as the baseline's, tested there):
//! GEGLU's forward 4.5x and T5's 4x faster at 64k outputs (`examples/activation_bench`).
//! CUDA (f32, bf16, f16): `cuda/gated.cu`, rounded at the same places with the device's
//! `tanhf`/`erff`/`expf` (checked within the dtype's precision, not to the bit); elsewhere
//! candle's ops.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape};
use candle_core::{Tensor, D};
use rayon::prelude::*;

use crate::activation::{activate, Activation, Real};
use crate::elem::{per_activation, per_dtype, Elem};
use crate::host;

/// `out = act(gate) * value` over slices of one length.
#[inline(always)]
fn forward_run<T: Elem>(act: Activation, out: &mut [T], gate: &[T], value: &[T]) {
    for ((o, &a), &v) in out.iter_mut().zip(gate).zip(value) {
        *o = T::store(T::round(act.forward(a.load())).mul(v.load()));
    }
}

/// The gradients of `act(gate) * value` for the output's gradient `g`.
#[inline(always)]
fn backward_run<T: Elem>(
    act: Activation,
    (d_gate, d_value): (&mut [T], &mut [T]),
    g: &[T],
    gate: &[T],
    value: &[T],
) {
    let it = d_gate.iter_mut().zip(d_value.iter_mut()).zip(g).zip(gate);
    for ((((dg, dv), &g), &a), &v) in it.zip(value) {
        let (g, a) = (g.load(), a.load());
        *dv = T::store(g.mul(T::round(act.forward(a))));
        *dg = T::store(act.backward(T::round(g.mul(v.load())), a));
    }
}

/// Rows of a whole number of `width`s that make about one [`host::CHUNK`].
fn rows_a_task(width: usize) -> usize {
    (host::CHUNK / width.max(1)).max(1)
}

/// Gate and value in two tensors of one shape (T5): the forward.
fn apart_forward<T: Elem>(act: Activation, gate: &[T], value: &[T]) -> Vec<T> {
    let mut out = vec![T::zero(); gate.len()];
    let run = |at: usize, c: &mut [T]| {
        let r = at..at + c.len();
        let (gate, value) = (&gate[r.clone()], &value[r]);
        crate::wide::run(
            #[inline(always)]
            || per_activation!(act, forward_run(c, gate, value)),
        )
    };
    if out.len() <= host::CHUNK {
        run(0, &mut out);
    } else {
        host::par_chunks(&mut out, run);
    }
    out
}

/// Gate and value in two tensors (T5): the backward, the gate's gradient then the value's.
fn apart_backward<T: Elem>(act: Activation, g: &[T], gate: &[T], value: &[T]) -> Vec<T> {
    let n = g.len();
    let mut out = vec![T::zero(); 2 * n];
    let (d_gate, d_value) = out.split_at_mut(n);
    let run = |at: usize, dg: &mut [T], dv: &mut [T]| {
        let r = at..at + dg.len();
        let (g, a, v) = (&g[r.clone()], &gate[r.clone()], &value[r]);
        crate::wide::run(
            #[inline(always)]
            || per_activation!(act, backward_run((dg, dv), g, a, v)),
        )
    };
    if n <= host::CHUNK {
        run(0, d_gate, d_value);
    } else {
        d_gate
            .par_chunks_mut(host::CHUNK)
            .zip(d_value.par_chunks_mut(host::CHUNK))
            .enumerate()
            .for_each(|(i, (dg, dv))| run(i * host::CHUNK, dg, dv));
    }
    out
}

/// Value and gate the two halves of each row of `h` (GEGLU): the forward over rows of `width`.
fn halves_forward<T: Elem>(act: Activation, h: &[T], width: usize) -> Vec<T> {
    let mut out = vec![T::zero(); h.len() / 2];
    if width == 0 {
        return out; // no elements (rows of nothing)
    }
    let run = |row0: usize, c: &mut [T]| {
        crate::wide::run(
            #[inline(always)]
            || {
                for (j, o) in c.chunks_mut(width).enumerate() {
                    let row = &h[(row0 + j) * 2 * width..(row0 + j + 1) * 2 * width];
                    let (value, gate) = row.split_at(width);
                    per_activation!(act, forward_run(o, gate, value))
                }
            },
        )
    };
    let rows = rows_a_task(width);
    if out.len() <= host::CHUNK {
        run(0, &mut out);
    } else {
        out.par_chunks_mut(rows * width)
            .enumerate()
            .for_each(|(i, c)| run(i * rows, c));
    }
    out
}

/// GEGLU's backward: the gradient of `h`, each row the value's half then the gate's.
fn halves_backward<T: Elem>(act: Activation, g: &[T], h: &[T], width: usize) -> Vec<T> {
    let mut out = vec![T::zero(); h.len()];
    if width == 0 {
        return out;
    }
    let run = |row0: usize, c: &mut [T]| {
        crate::wide::run(
            #[inline(always)]
            || {
                for (j, o) in c.chunks_mut(2 * width).enumerate() {
                    let row = row0 + j;
                    let (value, gate) = h[row * 2 * width..(row + 1) * 2 * width].split_at(width);
                    let g = &g[row * width..(row + 1) * width];
                    let (d_value, d_gate) = o.split_at_mut(width);
                    per_activation!(act, backward_run((d_gate, d_value), g, gate, value))
                }
            },
        )
    };
    let rows = rows_a_task(2 * width);
    if out.len() <= 2 * host::CHUNK {
        run(0, &mut out);
    } else {
        out.par_chunks_mut(rows * 2 * width)
            .enumerate()
            .for_each(|(i, c)| run(i * rows, c));
    }
    out
}

fn same_shape(what: &str, a: &Layout, b: &Layout) -> Result<()> {
    if a.shape() != b.shape() {
        bail!("{what}: shapes {:?} and {:?}", a.dims(), b.dims());
    }
    Ok(())
}

/// T5's form: `act(gate) * value` of two tensors.
struct Apart(Activation);

impl CustomOp2 for Apart {
    fn name(&self) -> &'static str {
        "ft-gated"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        same_shape("gated", l1, l2)?;
        let act = self.0;
        let out = per_dtype!("gated", s1, [(s1, l1), (s2, l2)], |a, v| {
            apart_forward(act, a, v)
        });
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        same_shape("gated", l1, l2)?;
        same_dtype("gated", s1.dtype(), s2.dtype())?;
        let n = l1.shape().elem_count();
        let rows = apart_rows(l1, 0);
        let out = crate::cuda::gated_forward((s1, l1), (s2, l2), n, &rows, self.0)?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        value: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let both = g
            .contiguous()?
            .apply_op3_no_bwd(gate, value, &ApartBackward(self.0))?;
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

/// The gradients of both operands, stacked: `[2, ..shape]`.
struct ApartBackward(Activation);

impl CustomOp3 for ApartBackward {
    fn name(&self) -> &'static str {
        "ft-gated-backward"
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
        same_shape("gated backward", l1, l2)?;
        same_shape("gated backward", l1, l3)?;
        let act = self.0;
        let what = "gated backward";
        let out = per_dtype!(what, s1, [(s1, l1), (s2, l2), (s3, l3)], |g, a, v| {
            apart_backward(act, g, a, v)
        });
        Ok((out, stacked(l1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let what = "gated backward";
        same_shape(what, l1, l2)?;
        same_shape(what, l1, l3)?;
        same_dtype(what, s1.dtype(), s2.dtype())?;
        same_dtype(what, s1.dtype(), s3.dtype())?;
        let n = l1.shape().elem_count();
        let out = crate::cuda::gated_backward(
            (s1, l1),
            (s2, l2),
            (s3, l3),
            (n, &apart_rows(l1, 0)),
            (2 * n, &apart_rows(l1, n)),
            self.0,
        )?;
        Ok((out, stacked(l1)))
    }
}

/// `[2, ..shape]`: the two gradients stacked.
fn stacked(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.dims());
    Shape::from(dims)
}

/// Two tensors' rows (T5's form): contiguous rows of the last dimension; the value's `value_at`
/// elements on (the stacked gradients: one tensor's length).
#[cfg(feature = "cuda")]
fn apart_rows(l: &Layout, value_at: usize) -> crate::cuda::Rows {
    let width = l.dims().last().copied().unwrap_or(1).max(1);
    crate::cuda::Rows {
        width,
        stride: width,
        value_at,
        gate_at: 0,
    }
}

/// GEGLU's rows: the value the first `width` of each `2 width`, the gate the rest.
#[cfg(feature = "cuda")]
fn halves_rows(width: usize) -> crate::cuda::Rows {
    crate::cuda::Rows {
        width,
        stride: 2 * width,
        value_at: 0,
        gate_at: width,
    }
}

#[cfg(feature = "cuda")]
fn same_dtype(what: &str, a: candle_core::DType, b: candle_core::DType) -> Result<()> {
    if a != b {
        bail!("{what}: the operands differ in dtype ({a:?}, {b:?})");
    }
    Ok(())
}

/// GEGLU's form: the last dimension's first half times `act` of its second.
struct Halves(Activation);

/// The last dimension's size, which must be even.
fn halved_width(what: &str, l: &Layout) -> Result<usize> {
    match l.dims().last() {
        Some(&w) if w % 2 == 0 => Ok(w / 2),
        _ => bail!("{what}: the last dimension of {:?} must be even", l.dims()),
    }
}

/// The shape with the last dimension halved to `width`.
fn halved_shape(l: &Layout, width: usize) -> Shape {
    let mut dims = l.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = width;
    }
    Shape::from(dims)
}

impl CustomOp1 for Halves {
    fn name(&self) -> &'static str {
        "ft-gated-halves"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (act, what) = (self.0, "gated halves");
        let width = halved_width(what, l)?;
        let out = per_dtype!(what, s, [(s, l)], |h| halves_forward(act, h, width));
        Ok((out, halved_shape(l, width)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let width = halved_width("gated halves", l)?;
        let n = l.shape().elem_count() / 2;
        let out = crate::cuda::gated_forward((s, l), (s, l), n, &halves_rows(width), self.0)?;
        Ok((out, halved_shape(l, width)))
    }

    fn bwd(&self, h: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            g.contiguous()?
                .apply_op2_no_bwd(h, &HalvesBackward(self.0))?,
        ))
    }
}

/// The gradient of the projection `h`.
struct HalvesBackward(Activation);

impl CustomOp2 for HalvesBackward {
    fn name(&self) -> &'static str {
        "ft-gated-halves-backward"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        hs: &CpuStorage,
        hl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (act, what) = (self.0, "gated halves backward");
        let width = halved_width(what, hl)?;
        if gl.shape().elem_count() * 2 != hl.shape().elem_count() {
            bail!("{what}: gradient {:?} for input {:?}", gl.dims(), hl.dims());
        }
        let out = per_dtype!(what, gs, [(gs, gl), (hs, hl)], |g, h| {
            halves_backward(act, g, h, width)
        });
        Ok((out, hl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        hs: &candle_core::CudaStorage,
        hl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let what = "gated halves backward";
        let width = halved_width(what, hl)?;
        let n = gl.shape().elem_count();
        if n * 2 != hl.shape().elem_count() {
            bail!("{what}: gradient {:?} for input {:?}", gl.dims(), hl.dims());
        }
        same_dtype(what, gs.dtype(), hs.dtype())?;
        let rows = halves_rows(width);
        let out = crate::cuda::gated_backward(
            (gs, gl),
            (hs, hl),
            (hs, hl),
            (n, &rows),
            (2 * n, &rows),
            self.0,
        )?;
        Ok((out, hl.shape().clone()))
    }
}

/// `act(gate) * value` with its backward (T5's gated feed-forward: `gate = wi_0 x`,
/// `value = wi_1 x`): one op on the CPU and CUDA (see the module), candle's ops elsewhere.
pub fn gated(gate: &Tensor, value: &Tensor, act: Activation) -> Result<Tensor> {
    if !crate::has_kernel(gate) {
        return activate(gate, act)? * value;
    }
    gate.contiguous()?
        .apply_op2(&value.contiguous()?, Apart(act))
}

/// `h[.., :n] * act(h[.., n:])` over the last dimension's halves, with its backward (diffusers'
/// GEGLU: `value, gate = proj(x).chunk(2, -1)`): one op on the CPU and CUDA, candle's ops
/// elsewhere.
pub fn gated_halves(h: &Tensor, act: Activation) -> Result<Tensor> {
    if !crate::has_kernel(h) {
        let n = h.dim(D::Minus1)? / 2;
        return h.narrow(D::Minus1, 0, n)? * activate(&h.narrow(D::Minus1, n, n)?, act)?;
    }
    h.contiguous()?.apply_op1(Halves(act))
}
