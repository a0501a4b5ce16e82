//! Cross-entropy of a linear head without the logits tensor: `sum_i -log softmax(h_i W^T)[y_i]`
//! over the rows whose label is not negative.
//!
//! Why: a vocabulary head's logits are rows x vocab (FLAN-T5: 32,128 columns), and the plain
//! composition (matmul, log-softmax, gather) keeps the logits, the log-probabilities and, in
//! backward, several more tensors of that size at once; on the t5-small bench that is the step's
//! peak, above every activation of the body. Here the rows are taken a chunk at a time: each
//! chunk's logits are computed, reduced to its loss and, when a gradient will be asked for, turned
//! into `softmax - onehot` and multiplied out into the gradients of `h` and `W` at once, then
//! dropped. The op keeps those two gradients (the size of `h` and of `W`, which backward produces
//! anyway) and hands them to backward scaled by the incoming gradient, so nothing is recomputed;
//! the idea of Liger-Kernel's fused linear cross-entropy. Logits and probabilities are in f32
//! (f64 for f64 inputs, which is how the finite-difference test runs); the products run in the
//! inputs' dtype, and `W`'s gradient is summed over chunks in f32.

mod rows;

use std::sync::Mutex;

#[cfg(feature = "cuda")]
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor, D};

/// Bytes one chunk's f32 logits may take; a chunk's working set is a few times this.
const CHUNK_BYTES: usize = 8 << 20;

/// The loss's gradients, computed in forward and taken by backward (so they are freed with it).
struct LinearCrossEntropy {
    loss: f64,
    /// f32, or f64 for f64 inputs.
    dtype: DType,
    grads: Mutex<Option<(Tensor, Tensor)>>,
}

impl LinearCrossEntropy {
    fn value(&self) -> CpuStorage {
        match self.dtype {
            DType::F64 => CpuStorage::F64(vec![self.loss]),
            _ => CpuStorage::F32(vec![self.loss as f32]),
        }
    }
}

impl candle_core::CustomOp2 for LinearCrossEntropy {
    fn name(&self) -> &'static str {
        "ft-linear-cross-entropy"
    }

    /// The loss was computed when the op was built; forward only hands out the scalar.
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((self.value(), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let v = self.value();
        Ok((
            s1.device().storage_from_cpu_storage_owned(v)?,
            Shape::from(()),
        ))
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let taken = self
            .grads
            .lock()
            .map_err(|_| candle_core::Error::Msg("linear cross-entropy: poisoned lock".into()))?
            .take();
        let Some((gh, gw)) = taken else {
            candle_core::bail!(
                "linear cross-entropy: backward ran twice, or on a loss built without gradients"
            )
        };
        // The scale (a mean's 1 / tokens, say) in f32, rounded once into the input's dtype:
        // scaling a bf16 gradient by a bf16 copy of it would round twice.
        let scale = |t: Tensor, like: &Tensor| -> Result<Tensor> {
            let acc = out_dtype(t.dtype());
            t.to_dtype(acc)?
                .broadcast_mul(&g.to_dtype(acc)?)?
                .to_dtype(like.dtype())
        };
        let gw = crate::grad_tap::hand_over(w, Some(scale(gw, w)?))?;
        Ok((Some(scale(gh, h)?), gw))
    }
}

fn out_dtype(input: DType) -> DType {
    if input == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// One chunk's summed loss and, when `grads`, `softmax - onehot` in the logits' dtype: the row
/// pass of [`rows`] for CPU tensors, candle's ops elsewhere (a GPU keeps subnormals at full
/// speed).
fn chunk_loss(logits: Tensor, lbl: &[u32], grads: bool) -> Result<(f64, Option<Tensor>)> {
    fn on_host<T: rows::RowFloat>(
        logits: &Tensor,
        lbl: &[u32],
        grads: bool,
    ) -> Option<Result<(f64, Option<Tensor>)>> {
        let (n, vocab) = logits.dims2().ok()?;
        let (loss, dl) = crate::host::with_slice::<T, _>(logits, |s| {
            rows::loss_and_dlogits(s, vocab, lbl, grads)
        })?;
        let dl = dl.map(|d| Tensor::from_vec(d, (n, vocab), logits.device()));
        Some(dl.transpose().map(|dl| (loss, dl)))
    }
    if let Some(r) =
        on_host::<f32>(&logits, lbl, grads).or_else(|| on_host::<f64>(&logits, lbl, grads))
    {
        return r;
    }
    with_candle_ops(logits, lbl, grads)
}

/// [`chunk_loss`] as a composition of candle's ops (devices other than the CPU), subnormal
/// probabilities kept.
fn with_candle_ops(logits: Tensor, lbl: &[u32], grads: bool) -> Result<(f64, Option<Tensor>)> {
    let (n, dev, acc) = (logits.dim(0)?, logits.device().clone(), logits.dtype());
    let lbl = Tensor::new(lbl, &dev)?.unsqueeze(1)?;
    let m = logits.max_keepdim(1)?;
    let z = logits.broadcast_sub(&m)?;
    drop(logits);
    let lse = z.exp()?.sum_keepdim(1)?.log()?;
    let picked = z.gather(&lbl, 1)?;
    let loss = (&lse - &picked)?
        .sum_all()?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    if !grads {
        return Ok((loss, None));
    }
    let p = z.broadcast_sub(&lse)?.exp()?;
    drop(z);
    let minus_one = Tensor::full(-1f64, (n, 1), &dev)?.to_dtype(acc)?;
    Ok((loss, Some(p.scatter_add(&lbl, &minus_one, 1)?)))
}

/// `sum -log softmax(h W^T)[label]` over rows with a label >= 0, as an f32 scalar (f64 for f64
/// inputs). `h` is [..., D], `w` [V, D], `labels` any integer tensor with `h`'s leading shape.
pub fn linear_cross_entropy(h: &Tensor, w: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let vocab = w.dim(0)?;
    let rows = (CHUNK_BYTES / (vocab.max(1) * 4)).max(1);
    linear_cross_entropy_chunked(h, w, labels, rows)
}

/// [`linear_cross_entropy`] with an explicit number of rows per chunk (tests use small ones).
pub fn linear_cross_entropy_chunked(
    h: &Tensor,
    w: &Tensor,
    labels: &Tensor,
    rows_per_chunk: usize,
) -> Result<Tensor> {
    let (vocab, d) = w.dims2()?;
    if h.dim(D::Minus1)? != d {
        candle_core::bail!(
            "linear cross-entropy: hidden size {} does not match the head's [{vocab}, {d}]",
            h.dim(D::Minus1)?
        );
    }
    let n = h.elem_count() / d.max(1);
    if labels.elem_count() != n {
        candle_core::bail!(
            "linear cross-entropy: {} labels for {n} rows",
            labels.elem_count()
        );
    }
    let acc = out_dtype(h.dtype());
    let want_grads = h.track_op() || w.track_op();
    let hd = h.detach().reshape((n, d))?;
    let wd = w.detach();
    let labels: Vec<i64> = labels.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
    let valid: Vec<u32> = (0..n as u32).filter(|&i| labels[i as usize] >= 0).collect();
    for &i in &valid {
        if labels[i as usize] as usize >= vocab {
            candle_core::bail!(
                "linear cross-entropy: label {} at row {i} is outside the vocabulary of {vocab}",
                labels[i as usize]
            );
        }
    }
    let dev = h.device();
    let mut loss = 0f64;
    let mut gw: Option<Tensor> = None;
    let mut gh_rows: Vec<Tensor> = Vec::new();
    for chunk in valid.chunks(rows_per_chunk.max(1)) {
        let idx = Tensor::new(chunk, dev)?;
        let lbl: Vec<u32> = chunk.iter().map(|&i| labels[i as usize] as u32).collect();
        let hc = hd.index_select(&idx, 0)?;
        let logits = hc.matmul(&wd.t()?)?.to_dtype(acc)?;
        let (part, dl) = chunk_loss(logits, &lbl, want_grads)?;
        loss += part;
        if let Some(dl) = dl {
            let dl = dl.to_dtype(h.dtype())?;
            gh_rows.push(dl.matmul(&wd)?);
            let part = dl.t()?.matmul(&hc)?.to_dtype(acc)?;
            // Summed in place where it can be (an f32 sum on the CPU): a new [vocab, d] sum per
            // chunk is 64 MiB of fresh pages at FLAN-T5's head.
            gw = Some(match gw {
                Some(sum) if crate::host::add_into(&sum, &part)? => sum,
                Some(sum) => (sum + part)?,
                None => part,
            });
        }
    }
    let grads = if want_grads {
        let gw = match gw {
            Some(t) => t,
            None => Tensor::zeros((vocab, d), acc, dev)?,
        };
        let gh = Tensor::zeros((n, d), h.dtype(), dev)?;
        let gh = if gh_rows.is_empty() {
            gh
        } else {
            let idx = Tensor::new(valid.as_slice(), dev)?;
            gh.index_add(&idx, &Tensor::cat(&gh_rows, 0)?, 0)?
        };
        Some((gh.reshape(h.shape())?, gw))
    } else {
        None
    };
    let op = LinearCrossEntropy {
        loss,
        dtype: acc,
        grads: Mutex::new(grads),
    };
    h.apply_op2(w, op)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU row pass and the candle composition the GPU takes give the same loss and
    /// `softmax - onehot` (logits with no subnormal probabilities, where the two agree up to
    /// rounding): the composition has no GPU test of its own.
    #[test]
    fn the_row_pass_and_candle_ops_agree() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let lbl = [3u32, 0, 6, 6];
        for dt in [DType::F32, DType::F64] {
            let logits = (Tensor::randn(0f64, 3.0, (4, 7), &dev)?).to_dtype(dt)?;
            for grads in [true, false] {
                let (a, da) = chunk_loss(logits.clone(), &lbl, grads)?;
                let (b, db) = with_candle_ops(logits.clone(), &lbl, grads)?;
                assert!((a - b).abs() <= 1e-5 * b.abs(), "{dt:?}: loss {a} vs {b}");
                assert_eq!(da.is_some(), grads);
                if let (Some(da), Some(db)) = (da, db) {
                    let diff = (da - &db)?.abs()?.max_all()?.to_dtype(DType::F64)?;
                    let diff = diff.to_scalar::<f64>()?;
                    assert!(diff < 1e-6, "{dt:?}: softmax - onehot off by {diff:e}");
                    // One -1 a row at the label: the rows sum to 0.
                    let sums = db.sum(1)?.abs()?.max_all()?.to_dtype(DType::F64)?;
                    assert!(sums.to_scalar::<f64>()? < 1e-5);
                }
            }
        }
        Ok(())
    }
}
