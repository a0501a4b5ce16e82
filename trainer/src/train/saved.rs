//! Checkpoints of a run: model files, `optimizer.safetensors` and `trainer_state.json`, written
//! atomically as a folder; and reading them back for an exact resume, refusing a checkpoint that
//! would resume otherwise (a state tensor missing, a step that is not a count).

use std::io::Write as _;
use std::path::Path;

use super::eval::BestState;
use super::task::Task;
use crate::error::{Error, Result};
use crate::update::MixedOptimizer;

/// Where a run is: what a checkpoint records besides the model and the optimizer.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Optimizer steps done.
    pub step: u64,
    pub epoch: usize,
    /// The best evaluation so far, when the run keeps a best checkpoint.
    pub best: Option<BestState>,
    /// How far out-of-memory errors had split the micro-batches, when they had: a resumed run
    /// of the same micro-batch size starts there instead of running out of memory again.
    pub split: Option<Split>,
}

/// An out-of-memory split: each micro-batch of `batch_size` samples halved `halvings` times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    pub halvings: u32,
    pub batch_size: usize,
}

/// What `trainer_state.json` holds.
pub(super) struct TrainerState {
    pub progress: Progress,
    pub data: serde_json::Value,
}

/// Writes model files, `optimizer.safetensors` and `trainer_state.json` into `dir`, atomically
/// as a whole: everything goes to `dir.tmp` first, which is renamed over `dir` at the end. A
/// failure (a full disk) names the checkpoint and removes the partial `dir.tmp`; what was saved
/// before stays as it was.
///
/// In a data-parallel run rank 0 calls it while every other rank sends what it holds of the
/// model ([`Task::serve_save`]) and then of the optimizer state
/// ([`MixedOptimizer::send_state`]), in that order, as rank 0 writes them.
pub fn save_checkpoint<T: Task>(
    task: &T,
    opt: &MixedOptimizer,
    at: &Progress,
    dir: &Path,
) -> Result<()> {
    if let Some(name) = opt.non_finite_weight()? {
        return Err(Error::Diverged(format!(
            "refusing to save {}: weight `{name}` holds inf or NaN (the last good checkpoint is \
             kept as it is)",
            dir.display()
        )));
    }
    let tmp = dir.with_extension("tmp");
    let written = write_into(task, opt, at, &tmp).and_then(|_| replace(&tmp, dir));
    written.map_err(|e| {
        let _ = std::fs::remove_dir_all(&tmp);
        Error::Invalid(format!(
            "saving checkpoint {} failed (the partial {} is removed; earlier checkpoints are \
             kept): {e}",
            dir.display(),
            tmp.display()
        ))
    })
}

/// Everything of a checkpoint, into the folder `tmp`.
fn write_into<T: Task>(task: &T, opt: &MixedOptimizer, at: &Progress, tmp: &Path) -> Result<()> {
    if tmp.exists() {
        std::fs::remove_dir_all(tmp).map_err(|e| Error::io(tmp, e))?;
    }
    std::fs::create_dir_all(tmp).map_err(|e| Error::io(tmp, e))?;
    task.save_model(tmp).map_err(Error::Task)?;
    let (opt_step, loss_scale, names) = opt.write_state(&tmp.join("optimizer.safetensors"))?;
    let state = serde_json::json!({
        "global_step": at.step,
        "epoch": at.epoch,
        "optimizer_step": opt_step,
        "loss_scale": loss_scale,
        // The state tensors the optimizer file must hold, so a resume can tell a missing one.
        "optimizer_tensors": names,
        "best": at.best.as_ref().map(BestState::to_json),
        "oom_split": at.split.map(|s| serde_json::json!({
            "halvings": s.halvings, "batch_size": s.batch_size,
        })),
        "data": task.data_state(),
    });
    ft_params::fs::write_atomic(&tmp.join("trainer_state.json"), |f| {
        f.write_all(
            serde_json::to_string_pretty(&state)
                .unwrap_or_default()
                .as_bytes(),
        )
    })?;
    Ok(())
}

/// Puts the finished `tmp` in place of `dir`.
fn replace(tmp: &Path, dir: &Path) -> Result<()> {
    if dir.exists() {
        let old = dir.with_extension("old");
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
        std::fs::rename(tmp, dir).map_err(|e| Error::io(dir, e))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        std::fs::rename(tmp, dir).map_err(|e| Error::io(dir, e))?;
    }
    Ok(())
}

/// Reads `trainer_state.json` and the optimizer's state of the checkpoint folder `dir` into
/// `opt`. Fields must be what a run writes (counts are non-negative integers); every state
/// tensor the checkpoint lists must be in its optimizer file.
pub(super) fn load_checkpoint_state(dir: &Path, opt: &mut MixedOptimizer) -> Result<TrainerState> {
    let path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Json {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let bad = |reason: String| Error::Json {
        path: path.clone(),
        reason,
    };
    let field = |k: &str| v.get(k).ok_or_else(|| bad(format!("missing `{k}`")));
    let count = |k: &str| -> Result<u64> {
        field(k)?.as_u64().ok_or_else(|| {
            bad(format!(
                "`{k}` is {}, not a count",
                field(k).map(|x| x.to_string()).unwrap_or_default()
            ))
        })
    };
    let step = count("global_step")?;
    let epoch = count("epoch")? as usize;
    let opt_step = count("optimizer_step")?;
    let loss_scale = field("loss_scale")?
        .as_f64()
        .filter(|s| s.is_finite() && *s > 0.0)
        .ok_or_else(|| bad("`loss_scale` is not a positive number".into()))?;
    let best = match v.get("best") {
        None | Some(serde_json::Value::Null) => None,
        Some(b) => Some(BestState::from_json(b).ok_or_else(|| bad(format!("`best` is {b}")))?),
    };
    // Absent in checkpoints written before the split was saved: none.
    let split = match v.get("oom_split") {
        None | Some(serde_json::Value::Null) => None,
        Some(s) => {
            let n = |k: &str| s.get(k).and_then(|x| x.as_u64());
            match (n("halvings"), n("batch_size")) {
                (Some(h), Some(b)) if h <= 64 => Some(Split {
                    halvings: h as u32,
                    batch_size: b as usize,
                }),
                _ => return Err(bad(format!("`oom_split` is {s}"))),
            }
        }
    };
    let data = field("data")?.clone();
    let opt_path = dir.join("optimizer.safetensors");
    // Where the optimizer keeps its state: the model's device, or the host when offloaded.
    let device = opt.state_device();
    let files = ft_params::weights::SafetensorsFiles::open(std::slice::from_ref(&opt_path))?;
    if let Some(listed) = v.get("optimizer_tensors").and_then(|l| l.as_array()) {
        for name in listed.iter().filter_map(|n| n.as_str()) {
            if files.meta(name).is_none() {
                return Err(Error::Invalid(format!(
                    "{}: state tensor `{name}` is missing (listed in {}): resuming would restart \
                     it from zero",
                    opt_path.display(),
                    path.display()
                )));
            }
        }
    }
    // One tensor at a time: the optimizer keeps a copy of each moment, so the file's tensor is
    // freed before the next is read (all of them at once would hold a second set of moments and
    // masters, gigabytes on a large model).
    opt.load_state(opt_step, loss_scale, &[])?;
    let names: Vec<String> = files.names().map(|s| s.to_string()).collect();
    for name in names {
        // 8-bit moments stay bytes; everything else is fp32 state.
        let dtype = match files.meta(&name).map(|m| m.dtype) {
            Some(safetensors::Dtype::U8) => candle_core::DType::U8,
            _ => candle_core::DType::F32,
        };
        let t = files.load(&name, None, dtype, &device, false)?;
        opt.load_state(opt_step, loss_scale, &[(name, t)])?;
    }
    Ok(TrainerState {
        progress: Progress {
            step,
            epoch,
            best,
            split,
        },
        data,
    })
}

/// Alone in the library's unit-test binary, so the counting allocator sees only this test.
#[cfg(test)]
mod resume_memory {
    use candle_core::{DType, Device, Tensor, Var};

    use super::load_checkpoint_state;
    use crate::ledger::alloc::{measure_peak, CountingAlloc};
    use crate::optim::AdamWConfig;
    use crate::update::{MixedOptimizer, Precision, StatePlacement};

    #[global_allocator]
    static ALLOC: CountingAlloc = CountingAlloc;

    const PARAMS: usize = 8;
    const ELEMS: usize = 2 << 20;

    fn optimizer() -> anyhow::Result<MixedOptimizer> {
        let params = (0..PARAMS)
            .map(|i| {
                let t = Tensor::ones(ELEMS, DType::BF16, &Device::Cpu)?;
                Ok((format!("p{i}"), Var::from_tensor(&t)?))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(MixedOptimizer::adamw(
            params,
            Precision::parse("bf16")?,
            StatePlacement::WithModel,
            AdamWConfig::default(),
            None,
        )?)
    }

    /// Resuming reads `optimizer.safetensors` one tensor at a time: the peak above the fresh
    /// optimizer is the restored moments plus about one tensor, not the file's whole contents
    /// (moments and masters) held next to the optimizer's copies of the moments. The restored
    /// state is the saved one.
    #[test]
    fn resume_holds_about_one_file_tensor_beyond_the_restored_state() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("ft-resume-memory-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let saved = {
            let mut a = optimizer()?;
            let grads = (0..PARAMS)
                .map(|i| Ok(Some(Tensor::full(0.1 * i as f32, ELEMS, &Device::Cpu)?)))
                .collect::<anyhow::Result<Vec<_>>>()?;
            a.step(grads, 1e-3)?;
            let (step, scale, tensors) = a.state();
            ft_params::fs::save_safetensors(&tensors, &dir.join("optimizer.safetensors"))?;
            let state = serde_json::json!({"global_step": 1, "epoch": 0, "optimizer_step": step,
                                           "loss_scale": scale, "data": null});
            std::fs::write(dir.join("trainer_state.json"), state.to_string())?;
            tensors[1].1.to_vec1::<f32>()?
        };
        let mut b = optimizer()?;
        let tensor = ELEMS * 4;
        let (restored, peak) = measure_peak(|| load_checkpoint_state(&dir, &mut b));
        let restored = restored?;
        std::fs::remove_dir_all(&dir)?;
        assert_eq!(restored.progress.step, 1);
        let (step, _, state) = b.state();
        assert_eq!(step, 1);
        assert_eq!(state[1].1.to_vec1::<f32>()?, saved);
        // Moments restored: 2 per parameter. The file also holds a master per parameter.
        let moments = 2 * PARAMS * tensor;
        eprintln!(
            "resume peak {} MiB: restored moments {} MiB, file {} MiB",
            peak >> 20,
            moments >> 20,
            (3 * PARAMS * tensor) >> 20
        );
        assert!(peak >= moments, "peak {peak} below the restored moments");
        assert!(
            peak <= moments + 3 * tensor,
            "resume peaked at {} MiB for {} MiB of restored moments (the file holds {} MiB)",
            peak >> 20,
            moments >> 20,
            (3 * PARAMS * tensor) >> 20
        );
        Ok(())
    }
}
