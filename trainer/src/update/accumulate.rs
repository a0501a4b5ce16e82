//! Gradient accumulation that gives the update of one large batch.
//!
//! The loss of a step over micro-batches must be normalised by what the *whole step* holds: for
//! seq2seq, each micro-batch's summed token loss is divided by the number of label tokens of all
//! micro-batches of the step; for images, by the number of samples. Averaging per-micro-batch means
//! (what `loss / accum` does) weights a short micro-batch's tokens more than a long one's, so it is
//! not the gradient of the big batch when token counts differ.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// What a step's loss is averaged over.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossNorm {
    /// Label tokens (non-padding) over all micro-batches of the step.
    Tokens(usize),
    /// Samples over all micro-batches of the step.
    Samples(usize),
}

impl LossNorm {
    /// Normaliser for a step whose micro-batches hold `counts` tokens (or samples) each.
    pub fn tokens(counts: &[usize]) -> Self {
        LossNorm::Tokens(counts.iter().sum())
    }

    pub fn samples(counts: &[usize]) -> Self {
        LossNorm::Samples(counts.iter().sum())
    }

    /// Turns a micro-batch's *summed* loss into its share of the step's mean loss.
    pub fn scale(&self, summed_loss: &Tensor) -> Result<Tensor> {
        let n = match self {
            LossNorm::Tokens(n) | LossNorm::Samples(n) => *n,
        };
        if n == 0 {
            return Err(Error::Invalid(
                "a step with no label tokens (or samples) has no loss to average".into(),
            ));
        }
        Ok((summed_loss / n as f64)?)
    }
}

/// Sums gradients over micro-batches in fp32, on the gradients' own device or on a given one
/// (the host, when the optimizer state is offloaded: the device then frees each micro-batch's
/// gradients as soon as they are added). The first micro-batch's gradients are kept as they
/// come (bf16 for a bf16 model) and widened only when a second one is added: a step of one
/// micro-batch never holds fp32 gradients of the whole model (4 bytes per parameter: 10.6 GiB
/// for FLAN-T5-XL), and the optimizers widen each gradient as they read it, exactly.
#[derive(Default)]
pub struct GradAccumulator {
    sums: Vec<Option<Tensor>>,
    /// Whether `sums[i]` is an fp32 sum of the accumulator's own, which later micro-batches may
    /// be added into in place; not while it is a micro-batch's gradient as it came (which may
    /// share storage with another parameter's: backprop hands one tensor to both sides of an
    /// addition).
    owned: Vec<bool>,
    micro_batches: usize,
    device: Option<Device>,
}

impl GradAccumulator {
    /// Sums on the device each gradient comes from.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sums on `device`; a gradient moves there in its own dtype and is widened to fp32 there.
    pub fn on(device: &Device) -> Self {
        GradAccumulator {
            device: Some(device.clone()),
            ..Self::default()
        }
    }

    /// Adds one micro-batch's gradients (same parameter order every time).
    pub fn add(&mut self, grads: Vec<Option<Tensor>>) -> Result<()> {
        self.reserve(grads.len())?;
        for (i, g) in grads.into_iter().enumerate() {
            if let Some(g) = g {
                self.add_one(i, g)?;
            }
        }
        self.end_micro_batch();
        Ok(())
    }

    /// Makes room for `n` parameters (the same `n` every micro-batch).
    pub fn reserve(&mut self, n: usize) -> Result<()> {
        if self.sums.is_empty() {
            self.sums = vec![None; n];
            self.owned = vec![false; n];
        }
        if n != self.sums.len() {
            return Err(Error::Invalid(format!(
                "accumulating {n} gradients into {}",
                self.sums.len()
            )));
        }
        Ok(())
    }

    /// Adds parameter `i`'s gradient of the current micro-batch (a fused backward adds each
    /// segment's as soon as that segment's backward ends); [`Self::end_micro_batch`] closes it.
    pub fn add_one(&mut self, i: usize, g: Tensor) -> Result<()> {
        let sum = self.combine(i, g)?;
        self.sums[i] = Some(sum);
        Ok(())
    }

    /// Counts a micro-batch whose gradients [`Self::add_one`] has added.
    pub fn end_micro_batch(&mut self) {
        self.micro_batches += 1;
    }

    /// Parameter `i`'s sum with the last micro-batch's gradient `g` added, taken out of the
    /// accumulator: what [`Self::take`] would return for it after `add_one(i, g)`, bit for bit,
    /// for a fused backward that steps each parameter as its final gradient arrives.
    pub fn take_with(&mut self, i: usize, g: Tensor) -> Result<Tensor> {
        let sum = self.combine(i, g)?;
        if let Some(o) = self.owned.get_mut(i) {
            *o = false;
        }
        Ok(sum)
    }

    /// Each `(i, g)` with parameter `i`'s sum added ([`Self::take_with`]); `grads` as they
    /// are when no micro-batch has been summed (a step without accumulation).
    pub fn take_with_each(&mut self, grads: Vec<(usize, Tensor)>) -> Result<Vec<(usize, Tensor)>> {
        if self.micro_batches == 0 {
            return Ok(grads);
        }
        grads
            .into_iter()
            .map(|(i, g)| Ok((i, self.take_with(i, g)?)))
            .collect()
    }

    /// Parameter `i`'s sum alone, taken out (`None` where none is held): a rank whose last
    /// micro-batch gave `i` no gradient adds it to the round in which another rank's did.
    pub fn take_one(&mut self, i: usize) -> Option<Tensor> {
        if let Some(o) = self.owned.get_mut(i) {
            *o = false;
        }
        self.sums.get_mut(i)?.take()
    }

    /// The parameters whose sums are still held, taken out (a fused backward steps those
    /// that got no gradient in the last micro-batch from their sums alone).
    pub fn take_remaining(&mut self) -> Vec<(usize, Tensor)> {
        let left = self
            .sums
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.take()?)))
            .collect();
        self.take();
        left
    }

    /// `sums[i] + g` in fp32 (or `g` as it comes when nothing is summed yet), `sums[i]` taken.
    fn combine(&mut self, i: usize, g: Tensor) -> Result<Tensor> {
        if i >= self.sums.len() {
            return Err(Error::Invalid(format!(
                "gradient of parameter {i} for an accumulator of {}",
                self.sums.len()
            )));
        }
        let g = match &self.device {
            Some(d) => g.to_device(d)?,
            None => g,
        };
        let g = g.detach();
        // On the host: one threaded pass each, adding into the sum in place (the sums are
        // the accumulator's own tensors). Elsewhere candle's ops, which on a GPU are one
        // kernel each anyway.
        Ok(match self.sums[i].take() {
            None => g,
            Some(prev) => {
                let prev = if self.owned[i] {
                    prev
                } else {
                    as_f32_sum(&prev)?
                };
                self.owned[i] = true;
                if ft_kernels::host::add_into(&prev, &g)? {
                    prev
                } else {
                    (prev + g.to_dtype(DType::F32)?)?.detach()
                }
            }
        })
    }

    /// The accumulator, moved out whole; an empty one on the same pinned device is left behind.
    /// (`std::mem::take` would leave one that sums on the gradients' own device: under
    /// `--offload-optimizer` on a GPU, every step after the first then kept a micro-batch's
    /// gradients on the GPU, a model's weight size more than planned.)
    pub fn take_whole(&mut self) -> Self {
        let empty = GradAccumulator {
            device: self.device.clone(),
            ..Self::default()
        };
        std::mem::replace(self, empty)
    }

    /// The device the sums are pinned to ([`Self::on`]), if any.
    pub fn pinned(&self) -> Option<&Device> {
        self.device.as_ref()
    }

    /// Where the sums live (for the ledger); the first gradient's device when not pinned.
    pub fn device(&self) -> &Device {
        self.device
            .as_ref()
            .or_else(|| self.sums.iter().flatten().next().map(|t| t.device()))
            .unwrap_or(&Device::Cpu)
    }

    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// Bytes held by the running sums (the ledger's `gradients`).
    pub fn bytes(&self) -> u64 {
        self.sums
            .iter()
            .flatten()
            .map(ft_params::bytes::tensor_bytes)
            .sum()
    }

    /// The summed gradients; the accumulator starts empty again.
    pub fn take(&mut self) -> Vec<Option<Tensor>> {
        self.micro_batches = 0;
        self.owned.clear();
        std::mem::take(&mut self.sums)
    }
}

/// A micro-batch's gradient as the start of an fp32 sum: on the host a new tensor, which
/// `add_into` may then write into; elsewhere (or strided) its fp32 cast, which is only ever
/// read, as the sum that follows is candle's new tensor.
fn as_f32_sum(t: &Tensor) -> Result<Tensor> {
    Ok(match ft_kernels::host::widened(t) {
        Some(w) => w?,
        None => t.to_dtype(DType::F32)?,
    })
}
