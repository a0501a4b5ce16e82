//! fewshot-ft's [`Task`]: episodes in, query cross-entropy out, validation accuracy, save layout.

use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use ft_models::fewshot::{Episode, FewShotModel};
use ft_params::ParamStore;
use ft_trainer::ledger::Ledger;
use ft_trainer::train::{Epochs, StepCtx, Task, TaskResult};

use crate::data::{sample_episode, EpisodeShape, ImageConfig, Split, Splits};

/// Mean accuracy over episodes with its 95% confidence interval (1.96 std / sqrt(n)), in %.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accuracy {
    pub mean: f64,
    pub ci95: f64,
    pub loss: f64,
    pub episodes: usize,
}

/// A few-shot model with its splits and episode settings.
pub struct FewShotTask {
    pub model: FewShotModel,
    pub store: Arc<ParamStore>,
    pub splits: Splits,
    pub shape: EpisodeShape,
    pub train_images: ImageConfig,
    pub eval_images: ImageConfig,
    pub device: Device,
    pub seed: u64,
    pub n_episode: usize,
    pub val_episodes: usize,
    /// Written as config.json beside the weights.
    pub config_json: serde_json::Value,
    /// Episode indices, epoch by epoch (each episode drawn from its index).
    epochs: Epochs<u64>,
}

impl FewShotTask {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: FewShotModel,
        store: Arc<ParamStore>,
        splits: Splits,
        shape: EpisodeShape,
        train_images: ImageConfig,
        eval_images: ImageConfig,
        device: Device,
        seed: u64,
        n_episode: usize,
        val_episodes: usize,
        config_json: serde_json::Value,
    ) -> Self {
        FewShotTask {
            model,
            store,
            splits,
            shape,
            train_images,
            eval_images,
            device,
            seed,
            n_episode,
            val_episodes,
            config_json,
            epochs: Epochs::default(),
        }
    }

    /// Accuracy on `episodes` episodes of `split`, drawn from `seed` (fixed, so validations of
    /// different epochs see the same episodes).
    pub fn accuracy(&self, split: &Split, episodes: usize, seed: u64) -> anyhow::Result<Accuracy> {
        let mut accs = Vec::with_capacity(episodes);
        let mut loss = 0f64;
        let queries = (self.shape.n_way * self.shape.n_query) as f64;
        for i in 0..episodes {
            let ep = sample_episode(
                split,
                self.shape,
                seed,
                i as u64,
                self.eval_images,
                &self.device,
            )?;
            let (l, correct) = self.model.evaluate(&ep)?;
            loss += l as f64 / queries;
            accs.push(100.0 * correct as f64 / queries);
        }
        let n = accs.len().max(1) as f64;
        let mean = accs.iter().sum::<f64>() / n;
        let std = (accs.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / n).sqrt();
        Ok(Accuracy {
            mean,
            ci95: 1.96 * std / n.sqrt(),
            loss: loss / n,
            episodes,
        })
    }

    /// Copies the weights of a saved checkpoint into the model (e.g. the best one before testing).
    pub fn load_weights(&self, dir: &Path) -> anyhow::Result<()> {
        let files = ft_params::weights::SafetensorsFiles::open(&[dir.join("model.safetensors")])?;
        for (name, t) in self.store.all() {
            // Every fewshot tensor is a Var (parameters and batch-norm buffers); `from_tensor` of
            // any other tensor would be a copy that `set` never carries into the model.
            anyhow::ensure!(
                t.is_variable(),
                "`{name}` is not a variable: it cannot be reloaded"
            );
            let v = candle_core::Var::from_tensor(&t)?;
            v.set(&files.load(&name, Some(t.dims()), t.dtype(), t.device(), false)?)?;
        }
        Ok(())
    }
}

/// The training episodes of `epoch`, by index: `n` of them, each epoch its own.
fn episodes(n: usize, epoch: usize) -> Vec<u64> {
    let n = n as u64;
    (0..n).map(|i| epoch as u64 * n + i).collect()
}

impl Task for FewShotTask {
    type Batch = Episode;

    fn start_epoch(&mut self, epoch: usize) -> TaskResult<()> {
        self.epochs.start(epoch, episodes(self.n_episode, epoch));
        Ok(())
    }

    fn next_batch(&mut self) -> TaskResult<Option<Episode>> {
        let Some(index) = self.epochs.next_item() else {
            return Ok(None);
        };
        Ok(Some(sample_episode(
            &self.splits.train,
            self.shape,
            self.seed,
            index,
            self.train_images,
            &self.device,
        )?))
    }

    fn skip_batch(&mut self) -> TaskResult<bool> {
        Ok(self.epochs.next_item().is_some())
    }

    fn counts(&self, ep: &Episode) -> (usize, usize) {
        (ep.n_way * ep.n_query, ep.n_way * (ep.k_shot + ep.n_query))
    }

    fn summed_loss(&mut self, ep: &Episode, ctx: &StepCtx) -> TaskResult<Tensor> {
        Ok(self.model.summed_loss(ep, true, ctx.checkpointer)?.0)
    }

    fn evaluate(&mut self, _step: u64, _ledger: &mut Ledger) -> TaskResult<Vec<(String, f64)>> {
        if self.val_episodes == 0 {
            return Ok(Vec::new()); // no validation: nothing to judge, the last model is tested
        }
        let a = self.accuracy(&self.splits.val, self.val_episodes, self.seed ^ 0x7A11)?;
        Ok(vec![
            ("accuracy".into(), a.mean),
            ("ci95".into(), a.ci95),
            ("loss".into(), a.loss),
        ])
    }

    fn save_model(&self, dir: &Path) -> TaskResult<()> {
        ft_params::fs::save_safetensors(&self.store.all(), &dir.join("model.safetensors"))?;
        let text = serde_json::to_string_pretty(&self.config_json)?;
        ft_params::fs::write_atomic(&dir.join("config.json"), |f| {
            std::io::Write::write_all(f, text.as_bytes())
        })?;
        Ok(())
    }

    fn data_state(&self) -> serde_json::Value {
        self.epochs.cursor().to_json()
    }

    fn restore_data_state(&mut self, s: &serde_json::Value) -> TaskResult<()> {
        let n = self.n_episode;
        self.epochs.restore(s, |epoch| episodes(n, epoch))
    }
}
