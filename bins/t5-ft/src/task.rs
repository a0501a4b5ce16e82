//! t5-ft's [`Task`]: its data order, forward, evaluation and Hugging Face save layout.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{Device, Tensor};
use ft_models::dropout::DropoutCtx;
use ft_models::t5::{T5Batch, T5};
use ft_params::ParamStore;
use ft_trainer::ledger::Ledger;
use ft_trainer::train::{EpochOrder, Epochs, StepCtx, Task, TaskResult};

use crate::data::RecordFile;
use crate::tokenize::Collator;

/// A T5 model with its training and evaluation data.
pub struct T5Task {
    pub model: T5,
    pub store: Arc<ParamStore>,
    pub collator: Collator,
    pub train: RecordFile,
    pub eval: Option<RecordFile>,
    /// The training records' order, epoch by epoch.
    pub order: EpochOrder,
    pub device: Device,
    pub tokenizer_path: PathBuf,
    /// Longest generation in evaluation.
    pub max_new_tokens: usize,
    /// Evaluate on at most this many records (0 = all).
    pub eval_limit: usize,
    epochs: Epochs<Vec<usize>>,
}

impl T5Task {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: T5,
        store: Arc<ParamStore>,
        collator: Collator,
        train: RecordFile,
        eval: Option<RecordFile>,
        order: EpochOrder,
        device: Device,
        tokenizer_path: PathBuf,
    ) -> Self {
        T5Task {
            model,
            store,
            collator,
            train,
            eval,
            order,
            device,
            tokenizer_path,
            max_new_tokens: 32,
            eval_limit: 0,
            epochs: Epochs::default(),
        }
    }

    /// Micro-batches per epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.order.batches_per_epoch()
    }

    fn eval_batches(&self) -> Vec<Vec<usize>> {
        let Some(eval) = &self.eval else {
            return Vec::new();
        };
        let n = if self.eval_limit > 0 {
            eval.len().min(self.eval_limit)
        } else {
            eval.len()
        };
        (0..n)
            .collect::<Vec<_>>()
            .chunks(self.order.batch_size.max(1))
            .map(|c| c.to_vec())
            .collect()
    }

    /// Mean token loss and exact-match rate of greedy generation on the eval file.
    pub fn evaluate_now(&self) -> anyhow::Result<Vec<(String, f64)>> {
        let Some(eval) = &self.eval else {
            return Ok(Vec::new());
        };
        let (mut loss_sum, mut tokens, mut exact, mut n) = (0f64, 0usize, 0usize, 0usize);
        for idx in self.eval_batches() {
            let examples = eval.read(&idx)?;
            let batch = self.collator.collate(&examples, &self.device)?;
            let loss = self.model.eval_summed_loss(&batch)?;
            loss_sum += loss.to_scalar::<f32>()? as f64;
            tokens += batch.label_tokens;
            let generated = self.model.generate_greedy(
                &batch.input_ids,
                &batch.attention_mask,
                self.max_new_tokens,
            )?;
            for (g, ex) in generated.iter().zip(&examples) {
                let text = self.collator.decode(g)?;
                if text.trim() == ex.target.trim() {
                    exact += 1;
                }
                n += 1;
            }
        }
        Ok(vec![
            ("loss".into(), loss_sum / tokens.max(1) as f64),
            ("exact_match".into(), exact as f64 / n.max(1) as f64),
        ])
    }
}

/// Writes config.json, model.safetensors and tokenizer.json: the layout transformers loads.
pub fn save_hf(model: &T5, store: &ParamStore, tokenizer: &Path, dir: &Path) -> anyhow::Result<()> {
    let mut cfg = serde_json::to_value(model.config())?;
    if let Some(obj) = cfg.as_object_mut() {
        obj.insert("model_type".into(), "t5".into());
        obj.insert(
            "architectures".into(),
            serde_json::json!(["T5ForConditionalGeneration"]),
        );
        obj.insert("is_encoder_decoder".into(), true.into());
        let (act, gated) = model.config().activation().map_err(anyhow::Error::msg)?;
        let _ = act;
        obj.insert("is_gated_act".into(), gated.into());
    }
    let text = serde_json::to_string_pretty(&cfg)?;
    ft_params::fs::write_atomic(&dir.join("config.json"), |f| {
        std::io::Write::write_all(f, text.as_bytes())
    })?;
    ft_params::fs::save_safetensors(&store.all(), &dir.join("model.safetensors"))?;
    let tok =
        std::fs::read(tokenizer).map_err(|e| anyhow::anyhow!("{}: {e}", tokenizer.display()))?;
    ft_params::fs::write_atomic(&dir.join("tokenizer.json"), |f| {
        std::io::Write::write_all(f, &tok)
    })?;
    Ok(())
}

impl Task for T5Task {
    type Batch = T5Batch;

    fn start_epoch(&mut self, epoch: usize) -> TaskResult<()> {
        self.epochs.start(epoch, self.order.batches(epoch));
        Ok(())
    }

    fn next_batch(&mut self) -> TaskResult<Option<T5Batch>> {
        let Some(idx) = self.epochs.next_item() else {
            return Ok(None);
        };
        let examples = self.train.read(&idx)?;
        Ok(Some(self.collator.collate(&examples, &self.device)?))
    }

    fn skip_batch(&mut self) -> TaskResult<bool> {
        Ok(self.epochs.next_item().is_some())
    }

    fn counts(&self, b: &T5Batch) -> (usize, usize) {
        (b.label_tokens, b.input_ids.dim(0).unwrap_or(0))
    }

    fn summed_loss(&mut self, b: &T5Batch, ctx: &StepCtx) -> TaskResult<Tensor> {
        let drop = DropoutCtx::train(self.model.config().dropout_rate, ctx.dropout_seed)
            .from_sample(ctx.first_sample);
        Ok(self.model.summed_loss(b, &drop, ctx.checkpointer)?)
    }

    fn split(&self, b: &T5Batch) -> TaskResult<Option<(T5Batch, T5Batch)>> {
        Ok(match b.len() {
            0 | 1 => None,
            n => Some(b.split_at(n / 2)?),
        })
    }

    fn evaluate(&mut self, _step: u64, _ledger: &mut Ledger) -> TaskResult<Vec<(String, f64)>> {
        Ok(self.evaluate_now()?)
    }

    fn save_model(&self, dir: &Path) -> TaskResult<()> {
        Ok(save_hf(
            &self.model,
            &self.store,
            &self.tokenizer_path,
            dir,
        )?)
    }

    fn data_state(&self) -> serde_json::Value {
        self.epochs.cursor().to_json()
    }

    fn restore_data_state(&mut self, s: &serde_json::Value) -> TaskResult<()> {
        let order = &self.order;
        self.epochs.restore(s, |epoch| order.batches(epoch))
    }
}
