//! A batch of matrix products `scale * op(a) op(b)` as one op on the CPU (f32, f64), `op`
//! transposing an operand or not, read in place: attention's scores `q k^T * scale` and its
//! output `p v`.
//!
//! Through candle's ops the scores are a copy of the transposed keys, a matmul that runs the
//! batch's products one after another, each over gemm's own threads (small products: a T5
//! head's 128 x 64 x 128 at about half the speed of one thread), and a second tensor for the
//! scale, each kept by the graph. Here the keys are read transposed where they lie, the scale
//! is gemm's factor on the product (one rounding, as multiplying the product after), and the
//! batch's products go on rayon's threads, one each (or, for a batch smaller than the threads,
//! one after another, each cut in blocks: [`crate::gemm_blocks`]). The backward is two batched
//! products of the same kind, only for the inputs in the graph.
//! `FT_BATCHED_OP=0` runs candle's ops.

use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu;
use crate::gemm_blocks::{scaled_product, GemmFloat, Mat};
use crate::host::{shaped_like, with_slice};

/// Whether the op runs (`FT_BATCHED_OP=0` turns it off), read once.
fn op_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switched_on(&ON, "FT_BATCHED_OP")
}

/// Whether [`batched_matmul`] of `a` and `b` runs as one op: both on the CPU, both f32 or both
/// f64, of one rank (at least 2) with equal batch dimensions, the op switched on. (The memory
/// plans count the op on the CPU in f32 and f64, also under `FT_BATCHED_OP=0`: the switch is
/// for measurements.)
pub fn is_one_op(a: &Tensor, b: &Tensor) -> bool {
    let r = a.rank();
    op_enabled()
        && a.device().is_cpu()
        && matches!(a.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
        && b.dtype() == a.dtype()
        && r >= 2
        && b.rank() == r
        && a.dims()[..r - 2] == b.dims()[..r - 2]
}

/// `scale * op(a) op(b)` over equal leading (batch) dimensions, `op` transposing the last two
/// axes where `ta` / `tb`: one op where [`is_one_op`] (inputs made contiguous first), candle's
/// matmul (the transposes as views, made contiguous) and a multiply elsewhere (where
/// [`crate::linear::matmul`] broadcasts batch dimensions).
pub fn batched_matmul(a: &Tensor, b: &Tensor, ta: bool, tb: bool, scale: f64) -> Result<Tensor> {
    if a.rank() < 2 || b.rank() < 2 {
        bail!(
            "batched matmul: {:?} and {:?} (rank >= 2)",
            a.dims(),
            b.dims()
        );
    }
    if is_one_op(a, b) {
        let op = Batched { ta, tb, scale };
        return a.contiguous()?.apply_op2(&b.contiguous()?, op);
    }
    let view = |t: &Tensor, transposed: bool| -> Result<Tensor> {
        let r = t.rank();
        if transposed {
            t.transpose(r - 2, r - 1)?.contiguous()
        } else {
            t.contiguous()
        }
    };
    let y = crate::linear::matmul(&view(a, ta)?, &view(b, tb)?)?;
    if scale != 1.0 {
        y * scale
    } else {
        Ok(y)
    }
}

/// The op: transposes and the scale.
#[derive(Clone, Copy)]
struct Batched {
    ta: bool,
    tb: bool,
    scale: f64,
}

/// One product's shape: `m x k` by `k x n`, and the batch's size.
#[derive(Clone, Copy)]
struct Dims {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
}

impl Batched {
    /// The shapes of `a` and `b` checked against each other: (dims, the output's shape).
    fn dims(&self, a: &Shape, b: &Shape) -> Result<(Dims, Shape)> {
        let (ad, bd) = (a.dims(), b.dims());
        let r = ad.len();
        if r < 2 || bd.len() != r || ad[..r - 2] != bd[..r - 2] {
            bail!("batched matmul: {ad:?} and {bd:?} (equal batch dimensions, rank >= 2)");
        }
        let (m, ka) = if self.ta {
            (ad[r - 1], ad[r - 2])
        } else {
            (ad[r - 2], ad[r - 1])
        };
        let (kb, n) = if self.tb {
            (bd[r - 1], bd[r - 2])
        } else {
            (bd[r - 2], bd[r - 1])
        };
        if ka != kb {
            bail!(
                "batched matmul: {ad:?}{} by {bd:?}{}: inner lengths {ka} and {kb}",
                if self.ta { "^T" } else { "" },
                if self.tb { "^T" } else { "" }
            );
        }
        let batch = ad[..r - 2].iter().product();
        let mut out = ad[..r - 2].to_vec();
        out.extend([m, n]);
        Ok((Dims { batch, m, n, k: ka }, Shape::from(out)))
    }
}

/// `dst[i] = scale * lhs[i] rhs[i]` for each item `i` of a batch, each `m x k` by `k x n` (the
/// operands transposed where their `Mat` says): the items on rayon's threads, one each, when
/// there are at least as many as threads; else one after another, each product cut in blocks.
fn products<T: GemmFloat>(
    lhs: (&[T], bool),
    rhs: (&[T], bool),
    (batch, m, n, k): (usize, usize, usize, usize),
    scale: T,
) -> Result<Vec<T>> {
    let mut dst = vec![T::zero(); batch * m * n];
    if batch == 0 || m * n == 0 {
        return Ok(dst);
    }
    let item = |i: usize, out: &mut [T], threads: bool| {
        let l = Mat::new(&lhs.0[i * m * k..][..m * k], lhs.1);
        let r = Mat::new(&rhs.0[i * k * n..][..k * n], rhs.1);
        scaled_product(out, l, r, m, n, k, scale, false, threads)
    };
    if batch >= rayon::current_num_threads() {
        dst.par_chunks_mut(m * n)
            .enumerate()
            .try_for_each(|(i, out)| item(i, out, false))?;
    } else {
        for (i, out) in dst.chunks_mut(m * n).enumerate() {
            item(i, out, true)?;
        }
    }
    Ok(dst)
}

impl CustomOp2 for Batched {
    fn name(&self) -> &'static str {
        "ft-batched-matmul"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (d, shape) = self.dims(al.shape(), bl.shape())?;
        fn run<T: GemmFloat>(
            op: &Batched,
            (a, al): (&CpuStorage, &Layout),
            (b, bl): (&CpuStorage, &Layout),
            d: Dims,
        ) -> Result<Vec<T>> {
            let (a, b) = (
                cpu::slice(a.as_slice::<T>()?, al)?,
                cpu::slice(b.as_slice::<T>()?, bl)?,
            );
            products(
                (a, op.ta),
                (b, op.tb),
                (d.batch, d.m, d.n, d.k),
                T::from_f64(op.scale),
            )
        }
        let y = match (a, b) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(run::<f32>(self, (a, al), (b, bl), d)?)
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(run::<f64>(self, (a, al), (b, bl), d)?)
            }
            _ => bail!("batched matmul: inputs neither both f32 nor both f64"),
        };
        Ok((y, shape))
    }

    /// With `c = s op(a) op(b)` and `g` its gradient: `op(a)`'s gradient is `s g op(b)^T` and
    /// `op(b)`'s is `s op(a)^T g`; each is formed directly in its input's layout (for a
    /// transposed input, the transpose of that: `s op(b) g^T`, `s g^T op(a)`).
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _c: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (d, _) = self.dims(a.shape(), b.shape())?;
        let (a_, b_, g_) = (a.contiguous()?, b.contiguous()?, g.contiguous()?);
        let Dims { batch, m, n, k } = d;
        fn run<T: GemmFloat>(
            op: &Batched,
            (a, b, g): (&Tensor, &Tensor, &Tensor),
            (want_a, want_b): (bool, bool),
            (batch, m, n, k): (usize, usize, usize, usize),
        ) -> Result<Pair<Vec<T>>> {
            let (ta, tb, s) = (op.ta, op.tb, T::from_f64(op.scale));
            let got = with_slice(a, |a: &[T]| {
                with_slice(b, |b: &[T]| {
                    with_slice(g, |g: &[T]| -> Result<_> {
                        // a's gradient in a's layout: [m, k] = g [m, n] x op(b)^T [n, k], or
                        // [k, m] = op(b) [k, n] x g^T [n, m].
                        let da = match (want_a, ta) {
                            (false, _) => None,
                            (true, false) => {
                                Some(products((g, false), (b, !tb), (batch, m, k, n), s)?)
                            }
                            (true, true) => {
                                Some(products((b, tb), (g, true), (batch, k, m, n), s)?)
                            }
                        };
                        // b's gradient in b's layout: [k, n] = op(a)^T [k, m] x g [m, n], or
                        // [n, k] = g^T [n, m] x op(a) [m, k].
                        let db = match (want_b, tb) {
                            (false, _) => None,
                            (true, false) => {
                                Some(products((a, !ta), (g, false), (batch, k, n, m), s)?)
                            }
                            (true, true) => {
                                Some(products((g, true), (a, ta), (batch, n, k, m), s)?)
                            }
                        };
                        Ok((da, db))
                    })
                })
            });
            got.flatten().flatten().ok_or_else(|| {
                candle_core::Error::Msg("batched matmul backward: tensors not on the CPU".into())
            })?
        }
        let want = (a.track_op(), b.track_op());
        let inputs = (&a_, &b_, &g_);
        match a.dtype() {
            candle_core::DType::F32 => {
                let (da, db) = run::<f32>(self, inputs, want, (batch, m, n, k))?;
                Ok((shaped_like(da, a)?, shaped_like(db, b)?))
            }
            candle_core::DType::F64 => {
                let (da, db) = run::<f64>(self, inputs, want, (batch, m, n, k))?;
                Ok((shaped_like(da, a)?, shaped_like(db, b)?))
            }
            t => bail!("batched matmul backward: {t:?} (f32 or f64)"),
        }
    }
}

/// The two inputs' gradients, each where it was formed.
type Pair<T> = (Option<T>, Option<T>);
