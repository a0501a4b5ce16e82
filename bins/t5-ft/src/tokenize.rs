//! Tokenization with truncation and per-batch dynamic padding (the seed's "smart padding").

use std::path::Path;

use candle_core::{Device, Tensor};
use ft_models::t5::T5Batch;
use tokenizers::{Tokenizer, TruncationParams};

use crate::data::Example;

/// Turns examples into padded [`T5Batch`]es.
pub struct Collator {
    source: Tokenizer,
    target: Tokenizer,
    pad_id: u32,
}

fn with_truncation(t: &Tokenizer, max_length: usize) -> anyhow::Result<Tokenizer> {
    let mut t = t.clone();
    t.with_truncation(Some(TruncationParams {
        max_length,
        ..Default::default()
    }))
    .map_err(|e| anyhow::anyhow!("tokenizer truncation: {e}"))?;
    t.with_padding(None);
    Ok(t)
}

impl Collator {
    /// Loads `tokenizer.json`, checking its vocabulary fits the model's embedding.
    pub fn from_file(
        path: &Path,
        max_source: usize,
        max_target: usize,
        pad_id: u32,
        model_vocab: usize,
    ) -> anyhow::Result<Self> {
        let tok = Tokenizer::from_file(path)
            .map_err(|e| anyhow::anyhow!("{}: cannot load tokenizer: {e}", path.display()))?;
        let vocab = tok.get_vocab_size(true);
        if vocab > model_vocab {
            anyhow::bail!(
                "{}: the tokenizer has {vocab} tokens but the model's embedding has only {model_vocab}",
                path.display()
            );
        }
        Ok(Collator {
            source: with_truncation(&tok, max_source)?,
            target: with_truncation(&tok, max_target)?,
            pad_id,
        })
    }

    /// Token ids of `text` as a source (truncated, with the tokenizer's special tokens).
    pub fn encode_source(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let e = self
            .source
            .encode(text, true)
            .map_err(|e| anyhow::anyhow!("tokenizing `{text}`: {e}"))?;
        Ok(e.get_ids().to_vec())
    }

    pub fn encode_target(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let e = self
            .target
            .encode(text, true)
            .map_err(|e| anyhow::anyhow!("tokenizing `{text}`: {e}"))?;
        Ok(e.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        self.source
            .decode(ids, true)
            .map_err(|e| anyhow::anyhow!("decoding: {e}"))
    }

    /// Tokenizes and pads `examples` to the longest source and target of the batch.
    pub fn collate(&self, examples: &[Example], device: &Device) -> anyhow::Result<T5Batch> {
        let src: Vec<Vec<u32>> = examples
            .iter()
            .map(|e| self.encode_source(&e.input))
            .collect::<anyhow::Result<_>>()?;
        let tgt: Vec<Vec<u32>> = examples
            .iter()
            .map(|e| self.encode_target(&e.target))
            .collect::<anyhow::Result<_>>()?;
        pad_batch(&src, &tgt, self.pad_id, device)
    }
}

/// Pads ids to rectangular tensors: sources with `pad` (mask 0), labels with -100.
pub fn pad_batch(
    src: &[Vec<u32>],
    tgt: &[Vec<u32>],
    pad: u32,
    device: &Device,
) -> anyhow::Result<T5Batch> {
    let b = src.len();
    let ls = src.iter().map(|s| s.len()).max().unwrap_or(0).max(1);
    let lt = tgt.iter().map(|s| s.len()).max().unwrap_or(0).max(1);
    let mut ids = Vec::with_capacity(b * ls);
    let mut mask = Vec::with_capacity(b * ls);
    for s in src {
        ids.extend(s.iter().copied().chain(std::iter::repeat(pad)).take(ls));
        mask.extend((0..ls).map(|i| if i < s.len() { 1f32 } else { 0. }));
    }
    let mut labels = Vec::with_capacity(b * lt);
    let mut count = 0;
    for t in tgt {
        count += t.len();
        labels.extend(
            t.iter()
                .map(|&x| x as i64)
                .chain(std::iter::repeat(-100))
                .take(lt),
        );
    }
    Ok(T5Batch {
        input_ids: Tensor::from_vec(ids, (b, ls), device)?,
        attention_mask: Tensor::from_vec(mask, (b, ls), device)?,
        labels: Tensor::from_vec(labels, (b, lt), device)?,
        label_tokens: count,
    })
}
