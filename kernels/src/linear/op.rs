//! `x W^T (+ b)` as one op on the CPU (f32, f64): its forward and backward are matrix products
//! of [`crate::gemm_blocks`] on the operands in place.
//!
//! Through candle's ops a linear layer is a reshape, a transpose, a matmul, a broadcast add of
//! the bias and a reshape back: five nodes, each of whose inputs gets a zero tensor and an add
//! in candle's backward, and the graph keeps both the product and the biased sum. Here it is
//! one node with one edge per input, the graph keeps the output alone, and the products run in
//! blocks on one thread each (`gemm_blocks`: faster than gemm's own threads at these shapes).
//! The input gradient is only computed for an input in the graph (`Tensor::track_op`).

use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::gemm_blocks::{product, spread_rows, GemmFloat, Mat};
use crate::host::{shaped_like, with_slice};
use crate::{cpu, grad_tap};

/// Rows (of the output) below which the bias is added on one thread.
const PAR_ROWS_ELEMS: usize = 1 << 15;

/// The op; with a bias it is a `CustomOp3` (x, weight, bias), without a `CustomOp2`.
pub(super) struct Linear;

/// Rows, input width and output width of `x` [.., din] against `w` [dout, din], checked.
fn dims(x: &Shape, w: &Shape, bias: Option<&Shape>) -> Result<(usize, usize, usize)> {
    let (&din, rest) = match x.dims().split_last() {
        Some(v) => v,
        None => bail!("linear: a scalar input"),
    };
    let [dout, wdin] = w.dims() else {
        bail!("linear: the weight must be [out, in], got {:?}", w.dims());
    };
    if *wdin != din || bias.is_some_and(|b| b.dims() != [*dout]) {
        bail!(
            "linear: input {:?}, weight {:?} and bias {:?} do not fit",
            x.dims(),
            w.dims(),
            bias.map(|b| b.dims().to_vec())
        );
    }
    Ok((rest.iter().product(), din, *dout))
}

/// The output's shape: `x`'s with the last axis `dout` wide.
fn out_shape(x: &Shape, dout: usize) -> Shape {
    let mut d = x.dims().to_vec();
    if let Some(last) = d.last_mut() {
        *last = dout;
    }
    Shape::from(d)
}

/// `y [rows, dout] = x [rows, din] W^T (+ b)`: the product on the blocks' threads, then the bias
/// added to each row (one add a value, as a separate bias add would).
fn forward<T: GemmFloat>(
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    (rows, din, dout): (usize, usize, usize),
) -> Result<Vec<T>> {
    let mut y = vec![T::zero(); rows * dout];
    let spread = spread_weight(w, rows, din, dout);
    let w = match &spread {
        Some((copy, ld)) => Mat::rows_apart(copy, true, *ld),
        None => Mat::new(w, true),
    };
    product(&mut y, Mat::new(x, false), w, rows, dout, din, false, true)?;
    if let (Some(b), true) = (b, dout > 0) {
        let add = |row: &mut [T]| row.iter_mut().zip(b).for_each(|(v, &bi)| *v += bi);
        if y.len() >= PAR_ROWS_ELEMS {
            y.par_chunks_mut(dout).for_each(add);
        } else {
            y.chunks_mut(dout).for_each(add);
        }
    }
    Ok(y)
}

/// Rows of the output from which the forward copies the weight into spread rows.
const SPREAD_MIN_ROWS: usize = 64;

/// The largest weight (in values, 64 MiB of f32) the forward copies.
const SPREAD_MAX_VALUES: usize = 1 << 24;

/// The weight [dout, din] copied with its rows [`spread_rows`] apart (and that stride), where
/// `din` puts them an even number of cache lines apart and the product is large enough. For
/// `x W^T` into a row-major output gemm packs W, gathering 64 of its rows a step: 512 or 2048
/// values apart (T5's layers), those rows fall in 2 or 1 of the L1 cache's sets and nearly every
/// value missed. A copy is one pass over W; the product is then the same values (gemm reads
/// them in the same order). Rows of 512 x 2048 -> 512 values: 11.7 -> 7.2 ms a product
/// (docs/benchmarks.md).
fn spread_weight<T: GemmFloat>(
    w: &[T],
    rows: usize,
    din: usize,
    dout: usize,
) -> Option<(Vec<T>, usize)> {
    let ld = spread_rows::<T>(din);
    if din == 0 || ld == din || rows < SPREAD_MIN_ROWS || dout.checked_mul(ld)? > SPREAD_MAX_VALUES
    {
        return None;
    }
    let mut copy = vec![T::zero(); dout * ld];
    copy.par_chunks_mut(ld)
        .zip(w.par_chunks(din))
        .with_min_len(64)
        .for_each(|(to, from)| to[..din].copy_from_slice(from));
    Some((copy, ld))
}

/// The forward on storages of one dtype (f32 or f64).
fn forward_storage(
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    b: Option<(&CpuStorage, &Layout)>,
) -> Result<(CpuStorage, Shape)> {
    let d = dims(x.1.shape(), w.1.shape(), b.map(|b| b.1.shape()))?;
    fn run<T: GemmFloat>(
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
        d: (usize, usize, usize),
    ) -> Result<Vec<T>> {
        let bias = match b {
            Some((s, l)) => Some(cpu::slice(s.as_slice::<T>()?, l)?),
            None => None,
        };
        let (xs, ws) = (x.0.as_slice::<T>()?, w.0.as_slice::<T>()?);
        forward(cpu::slice(xs, x.1)?, cpu::slice(ws, w.1)?, bias, d)
    }
    let y = match x.0 {
        CpuStorage::F32(_) => CpuStorage::F32(run::<f32>(x, w, b, d)?),
        CpuStorage::F64(_) => CpuStorage::F64(run::<f64>(x, w, b, d)?),
        _ => bail!("linear op: an input neither f32 nor f64"),
    };
    Ok((y, out_shape(x.1.shape(), d.2)))
}

/// Which gradients a backward forms: those of the inputs in a graph (`Tensor::track_op`; a
/// frozen weight or an input outside the graph gets none, and its product is skipped).
#[derive(Clone, Copy)]
struct Wanted {
    dx: bool,
    dw: bool,
    db: bool,
}

/// The gradients of the input, the weight and the bias, each where wanted.
type Grads<T> = (Option<T>, Option<T>, Option<T>);

/// The backward from `dy` [rows, dout], each gradient where `wanted`: `dx = dy W`,
/// `dW = dy^T x`, and `db`, each column of `dy` summed in f64, rows in order.
fn backward<T: GemmFloat>(
    x: &[T],
    w: &[T],
    dy: &[T],
    (rows, din, dout): (usize, usize, usize),
    wanted: Wanted,
) -> Result<Grads<Vec<T>>> {
    // `dst [m, n] = lhs [m, k] rhs [k, n]` on the blocks' threads.
    let times = |lhs: Mat<T>, rhs: Mat<T>, (m, n, k): (usize, usize, usize)| {
        let mut dst = vec![T::zero(); m * n];
        product(&mut dst, lhs, rhs, m, n, k, false, true).map(|()| dst)
    };
    let dx = wanted
        .dx
        .then(|| times(Mat::new(dy, false), Mat::new(w, false), (rows, din, dout)))
        .transpose()?;
    let dw = wanted
        .dw
        .then(|| times(Mat::new(dy, true), Mat::new(x, false), (dout, din, rows)))
        .transpose()?;
    let db = wanted.db.then(|| {
        let mut sums = vec![0f64; dout];
        for row in dy.chunks(dout.max(1)) {
            sums.iter_mut().zip(row).for_each(|(s, v)| *s += v.to_f64());
        }
        sums.into_iter().map(T::from_f64).collect()
    });
    Ok((dx, dw, db))
}

/// [`backward`] on tensors (CPU, f32 or f64), read in place: (dx, dW, db), each `None` for an
/// input outside the graph.
fn backward_tensors(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    dy: &Tensor,
) -> Result<Grads<Tensor>> {
    let d = dims(x.shape(), w.shape(), bias.map(|b| b.shape()))?;
    fn run<T: GemmFloat>(
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        dy: &Tensor,
        d: (usize, usize, usize),
    ) -> Result<Grads<Tensor>> {
        let (x_, w_, dy_) = (x.contiguous()?, w.contiguous()?, dy.contiguous()?);
        let wanted = Wanted {
            dx: x.track_op(),
            dw: w.track_op(),
            db: bias.is_some_and(|b| b.track_op()),
        };
        let (dx, dw, db) = with_slice(&x_, |xs| {
            with_slice(&w_, |ws| {
                with_slice(&dy_, |ds| backward::<T>(xs, ws, ds, d, wanted))
            })
        })
        .flatten()
        .flatten()
        .ok_or_else(|| {
            candle_core::Error::Msg("linear backward: tensors not on the CPU".into())
        })??;
        let db = match bias {
            Some(b) => shaped_like(db, b)?,
            None => None,
        };
        Ok((shaped_like(dx, x)?, shaped_like(dw, w)?, db))
    }
    match x.dtype() {
        candle_core::DType::F32 => run::<f32>(x, w, bias, dy, d),
        candle_core::DType::F64 => run::<f64>(x, w, bias, dy, d),
        t => bail!("linear backward: {t:?} (f32 or f64)"),
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "ft-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        forward_storage((xs, xl), (ws, wl), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = backward_tensors(x, w, None, dy)?;
        Ok((dx, grad_tap::hand_over(w, dw)?))
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "ft-linear-bias"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        forward_storage((xs, xl), (ws, wl), Some((bs, bl)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = backward_tensors(x, w, Some(b), dy)?;
        Ok((dx, grad_tap::hand_over(w, dw)?, grad_tap::hand_over(b, db)?))
    }
}
