//! A checkpoint save that fails half-way (a full disk) names the checkpoint, removes its partial
//! folder and leaves the checkpoint saved before in place.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{DType, Device, Tensor, Var};
use ft_trainer::ledger::Ledger;
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer};
use ft_trainer::train::{save_checkpoint, Progress, StepCtx, Task, TaskResult};
use ft_trainer::update::{MixedOptimizer, Precision, StatePlacement};

/// A task whose model save writes part of a file, then fails as a full disk would, when told.
struct Saver {
    w: Var,
    fail: AtomicBool,
}

impl Task for Saver {
    type Batch = ();
    fn start_epoch(&mut self, _: usize) -> TaskResult<()> {
        Ok(())
    }
    fn next_batch(&mut self) -> TaskResult<Option<()>> {
        Ok(None)
    }
    fn counts(&self, _: &()) -> (usize, usize) {
        (0, 0)
    }
    fn summed_loss(&mut self, _: &(), _: &StepCtx) -> TaskResult<Tensor> {
        Ok(self.w.as_tensor().sum_all()?)
    }
    fn evaluate(&mut self, _: u64, _: &mut Ledger) -> TaskResult<Vec<(String, f64)>> {
        Ok(Vec::new())
    }
    fn save_model(&self, dir: &Path) -> TaskResult<()> {
        if self.fail.load(Ordering::Relaxed) {
            std::fs::write(dir.join("model.safetensors"), b"half a file")?;
            return Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "No space left on device",
            )
            .into());
        }
        ft_params::fs::save_safetensors(
            &[("w".into(), self.w.as_tensor().clone())],
            &dir.join("model.safetensors"),
        )?;
        Ok(())
    }
    fn data_state(&self) -> serde_json::Value {
        serde_json::json!({"epoch": 0, "cursor": 0})
    }
    fn restore_data_state(&mut self, _: &serde_json::Value) -> TaskResult<()> {
        Ok(())
    }
}

#[test]
fn a_failed_save_names_the_checkpoint_and_keeps_the_last_one() -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("ft-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let w = Var::from_tensor(&Tensor::ones(4, DType::F32, &Device::Cpu)?)?;
    let task = Saver {
        w: w.clone(),
        fail: AtomicBool::new(false),
    };
    let adamw = |n| -> Box<dyn Optimizer> { Box::new(AdamW::new(n, AdamWConfig::default())) };
    let opt = MixedOptimizer::new(
        vec![("w".into(), w)],
        Precision::parse("f32")?,
        StatePlacement::WithModel,
        adamw,
        None,
    )?;
    let dir = root.join("checkpoint-1");
    let at = Progress {
        step: 1,
        epoch: 0,
        best: None,
        split: None,
    };
    save_checkpoint(&task, &opt, &at, &dir)?;
    let saved = std::fs::read(dir.join("model.safetensors"))?;
    task.fail.store(true, Ordering::Relaxed);
    let e = save_checkpoint(&task, &opt, &at, &dir)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("checkpoint-1") && e.contains("No space left on device"),
        "{e}"
    );
    assert!(
        !root.join("checkpoint-1.tmp").exists(),
        "the partial folder is left behind"
    );
    assert_eq!(
        std::fs::read(dir.join("model.safetensors"))?,
        saved,
        "the saved one changed"
    );
    std::fs::remove_dir_all(&root)?;
    Ok(())
}
