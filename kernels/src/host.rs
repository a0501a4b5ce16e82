//! Threaded single passes over host tensors: what an offloaded optimizer does with gradients on
//! the CPU at every micro-batch (sum into fp32) and every step (global norm, clip, round the
//! updated masters to the weights' dtype).
//!
//! candle's CPU kernels run these on one thread, several passes each (a widening cast, then an
//! add into a new tensor): at SDXL-UNet size (2.57B parameters) that is seconds per micro-batch
//! against a fraction of a second of GPU work. Each function here gives the bits of the candle
//! op it replaces (f32 add and multiply, round-to-nearest-even narrowing; tested in
//! `trainer/tests/host_ops.rs`), except the sum of squares, which adds in
//! f64 per thread and so is at least as accurate as candle's f32 sum.

use candle_core::{
    backend::BackendStorage, CpuStorage, DType, InplaceOp2, Layout, Storage, Tensor,
};
use half::{bf16, f16};

use rayon::prelude::*;

/// Elements one task takes: below this, spreading the work costs more than it saves. A
/// multiple of the 8-bit optimizer's 256-value blocks, so its tasks hold whole blocks.
pub const CHUNK: usize = 1 << 16;

/// A float the host passes read as f32: f32 itself, or bf16/f16 widened exactly (as candle's
/// cast), so a low-precision gradient is read in place rather than copied to f32 first.
pub trait Widen: candle_core::WithDType + Copy + Send + Sync {
    fn widen(self) -> f32;
}

impl Widen for f32 {
    fn widen(self) -> f32 {
        self
    }
}

impl Widen for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Widen for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// Runs `f(offset, chunk)` over `out` in chunks of [`CHUNK`] on rayon's threads.
pub fn par_chunks<A: Send>(out: &mut [A], f: impl Fn(usize, &mut [A]) + Sync) {
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, c)| f(i * CHUNK, c));
}

/// Runs `f` on the elements of a contiguous f32 CPU tensor; `None` for anything else.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Option<R> {
    with_slice(t, f)
}

/// Runs `f` on the elements of a contiguous CPU tensor of `T`'s dtype, read in place; `None`
/// for anything else.
pub fn with_slice<T: candle_core::WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> R,
) -> Option<R> {
    if t.dtype() != T::DTYPE {
        return None;
    }
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(cpu), Some((a, b))) => cpu.as_slice::<T>().ok().map(|v| f(&v[a..b])),
        _ => None,
    }
}

/// Where `t`'s storage lives: equal for tensors that share it (views, clones, `to_dtype` to the
/// same dtype), whatever their offsets.
pub fn storage_key(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    &*storage as *const Storage as usize
}

/// Runs `f` on the elements of a contiguous f32 CPU tensor, writable in place: every tensor
/// that shares its storage sees the change (as after `Var::set`). `Ok(None)` for any other
/// tensor. Why: an update that writes its result into the tensors it read (AdamW's weight and
/// moments) needs no fresh buffers, whose first touch costs a page fault per 4 KiB.
///
/// The storage stays write-locked while `f` runs: inside `f`, reading or writing another
/// tensor that shares it ([`storage_key`]) would wait forever. Callers check first.
pub fn with_f32_mut<R>(
    t: &Tensor,
    f: impl FnOnce(&mut [f32]) -> R,
) -> candle_core::Result<Option<R>> {
    if t.dtype() != DType::F32 || !t.device().is_cpu() || !t.is_contiguous() {
        return Ok(None);
    }
    let op = InPlace {
        f: std::cell::Cell::new(Some(f)),
        out: std::cell::Cell::new(None),
    };
    t.inplace_op1(&op)?;
    Ok(op.out.into_inner())
}

/// The op behind [`with_f32_mut`]: candle hands it the storage under its write lock.
struct InPlace<F, R> {
    f: std::cell::Cell<Option<F>>,
    out: std::cell::Cell<Option<R>>,
}

impl<F: FnOnce(&mut [f32]) -> R, R> candle_core::InplaceOp1 for InPlace<F, R> {
    fn name(&self) -> &'static str {
        "host-in-place"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (Some((a, b)), CpuStorage::F32(v), Some(f)) =
            (l.contiguous_offsets(), s, self.f.take())
        else {
            candle_core::bail!("host-in-place: not a contiguous f32 tensor")
        };
        self.out.set(Some(f(&mut v[a..b])));
        Ok(())
    }
}

/// `acc += g` in place, `acc` a contiguous f32 CPU tensor, `g` a contiguous f32/bf16/f16 CPU
/// tensor of the same shape (widened exactly). `Ok(false)` when the tensors are not of that
/// kind: the caller then adds with candle's ops. `acc` must own its storage (the accumulator's
/// sums do): every tensor sharing it sees the change.
pub fn add_into(acc: &Tensor, g: &Tensor) -> candle_core::Result<bool> {
    let host_contiguous = |t: &Tensor| t.device().is_cpu() && t.is_contiguous();
    if acc.dtype() != DType::F32
        || !host_contiguous(acc)
        || !host_contiguous(g)
        || acc.dims() != g.dims()
        || !matches!(g.dtype(), DType::F32 | DType::BF16 | DType::F16)
    {
        return Ok(false);
    }
    acc.inplace_op2(g, &AddInto)?;
    Ok(true)
}

struct AddInto;

impl InplaceOp2 for AddInto {
    fn name(&self) -> &'static str {
        "host-add-into"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (Some((a, b)), Some((c, d))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("host-add-into: tensors must be contiguous")
        };
        let dtype = s2.dtype();
        let CpuStorage::F32(acc) = s1 else {
            candle_core::bail!("host-add-into: the sum must be f32")
        };
        let acc = &mut acc[a..b];
        if d - c != acc.len() {
            candle_core::bail!("host-add-into: {} vs {} elements", acc.len(), d - c);
        }
        match s2 {
            CpuStorage::F32(g) => add_widened(acc, &g[c..d]),
            CpuStorage::BF16(g) => add_widened(acc, &g[c..d]),
            CpuStorage::F16(g) => add_widened(acc, &g[c..d]),
            _ => candle_core::bail!("host-add-into: no {dtype:?} gradients"),
        }
        Ok(())
    }
}

fn add_widened<T: Widen>(acc: &mut [f32], g: &[T]) {
    par_chunks(acc, |at, out| {
        for (x, y) in out.iter_mut().zip(&g[at..]) {
            *x += y.widen();
        }
    });
}

/// A contiguous bf16/f16/f32 CPU tensor widened to a new f32 tensor (exact, as candle's cast;
/// always a tensor of its own, so that [`add_into`] may add into it); `None` for anything else.
pub fn widened(g: &Tensor) -> Option<candle_core::Result<Tensor>> {
    if !g.device().is_cpu() || !g.is_contiguous() {
        return None;
    }
    fn widen<T: Widen>(g: &Tensor) -> candle_core::Result<Tensor> {
        let (storage, layout) = g.storage_and_layout();
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("widen: not contiguous")
        };
        let Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("widen: not on the CPU")
        };
        let x = &T::cpu_storage_as_slice(cpu)?[a..b];
        let mut out = vec![0f32; x.len()];
        par_chunks(&mut out, |at, o| {
            for (o, v) in o.iter_mut().zip(&x[at..]) {
                *o = v.widen();
            }
        });
        Tensor::from_vec(out, g.shape(), g.device())
    }
    match g.dtype() {
        DType::F32 => Some(widen::<f32>(g)),
        DType::BF16 => Some(widen::<bf16>(g)),
        DType::F16 => Some(widen::<f16>(g)),
        _ => None,
    }
}

/// `g * coef` as candle's `affine` computes it (`x * coef + 0.0` in f32), for a contiguous f32
/// CPU tensor; `None` for anything else.
pub fn scaled(g: &Tensor, coef: f64) -> Option<candle_core::Result<Tensor>> {
    if !g.device().is_cpu() {
        return None;
    }
    let (mul, add) = (coef as f32, 0f32);
    with_f32(g, |x| {
        let mut out = vec![0f32; x.len()];
        par_chunks(&mut out, |at, o| {
            for (o, v) in o.iter_mut().zip(&x[at..]) {
                *o = *v * mul + add;
            }
        });
        Tensor::from_vec(out, g.shape(), g.device())
    })
}

/// Sum of squares of a contiguous f32 CPU tensor; `None` for anything else. Each block of
/// [`CHUNK`] elements is summed in f64 ([`block_sum_squares`]) and the block sums are added in
/// order, so the result does not depend on how many cores share the work (the clip factor, and
/// so the weights, are the same on every machine).
pub fn sum_squares(g: &Tensor) -> Option<f64> {
    if !g.device().is_cpu() {
        return None;
    }
    with_f32(g, |x| {
        let sums: Vec<f64> = x.par_chunks(CHUNK).map(block_sum_squares).collect();
        sums.iter().sum()
    })
}

/// Running sums [`block_sum_squares`] keeps side by side.
pub const SUM_LANES: usize = 8;

/// One block's sum of squares in f64: element `i` into lane `i % SUM_LANES`, the lanes added in
/// order at the end. One running sum made each add wait for the one before: 89.5M values took
/// 88-92 ms that way and take 25-28 ms in eight lanes (`examples/time_sum_squares`).
pub fn block_sum_squares(c: &[f32]) -> f64 {
    let mut lanes = [0f64; SUM_LANES];
    let chunks = c.chunks_exact(SUM_LANES);
    let rest = chunks.remainder();
    for v in chunks {
        for (l, v) in lanes.iter_mut().zip(v) {
            *l += (*v as f64) * (*v as f64);
        }
    }
    for (l, v) in lanes.iter_mut().zip(rest) {
        *l += (*v as f64) * (*v as f64);
    }
    lanes.iter().sum()
}

/// A contiguous f32 CPU tensor rounded to bf16 or f16 (to nearest, ties to even, as candle's
/// cast); `None` for anything else.
pub fn narrowed(t: &Tensor, dtype: DType) -> Option<candle_core::Result<Tensor>> {
    if !t.device().is_cpu() {
        return None;
    }
    fn cast<T: Copy + Send + Default + candle_core::WithDType>(
        x: &[f32],
        t: &Tensor,
        round: impl Fn(f32) -> T + Sync,
    ) -> candle_core::Result<Tensor> {
        let mut out = vec![T::default(); x.len()];
        par_chunks(&mut out, |at, o| {
            for (o, v) in o.iter_mut().zip(&x[at..]) {
                *o = round(*v);
            }
        });
        Tensor::from_vec(out, t.shape(), t.device())
    }
    match dtype {
        DType::BF16 => with_f32(t, |x| cast(x, t, bf16::from_f32)),
        DType::F16 => with_f32(t, |x| cast(x, t, f16::from_f32)),
        _ => None,
    }
}

/// A gradient's values (where it was formed) as a tensor shaped as its input, on its device.
pub(crate) fn shaped_like<T: candle_core::WithDType>(
    values: Option<Vec<T>>,
    like: &Tensor,
) -> candle_core::Result<Option<Tensor>> {
    values
        .map(|v| Tensor::from_vec(v, like.shape(), like.device()))
        .transpose()
}
