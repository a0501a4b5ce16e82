//! The shared loop: the loss falls, checkpoints land atomically with metrics, and a resumed run
//! continues the same loss curve as an uninterrupted one.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use ft_params::checkpoint::Checkpointer;
use ft_params::rng::SplitMix64;
use ft_params::weights::SafetensorsFiles;
use ft_params::{Init, ParamBuilder, ParamStore};
use ft_trainer::ledger::Ledger;
use ft_trainer::optim::{AdamW, AdamWConfig};
use ft_trainer::train::schedule::{LrSchedule, ScheduleKind};
use ft_trainer::train::{self, BestConfig, LoopConfig, StepCtx, Task, TaskResult, Units};
use ft_trainer::update::{MixedOptimizer, Precision, StatePlacement, StepMode, StepModeRequest};

/// Noisy linear regression with a shuffled dataset and dropout on the input.
struct Regression {
    w: Tensor,
    xs: Vec<Vec<f32>>,
    ys: Vec<f32>,
    order: Vec<usize>,
    cursor: usize,
    epoch: usize,
    batch: usize,
}

impl Regression {
    fn new(store_src: Option<&Path>) -> anyhow::Result<(Self, std::sync::Arc<ParamStore>)> {
        let store = ParamStore::new();
        let mut pb = ParamBuilder::new(store.clone(), DType::BF16, &Device::Cpu, 5);
        if let Some(dir) = store_src {
            let files = SafetensorsFiles::open(&[dir.join("model.safetensors")])?;
            pb = pb.with_source(std::sync::Arc::new(files));
        }
        let w = pb.get(&[4, 1], "w", Init::Zeros)?;
        let mut rng = SplitMix64::new(9);
        let truth = [0.5f32, -1.0, 2.0, 0.25];
        let mut xs = Vec::new();
        let mut ys = Vec::new();
        for _ in 0..37 {
            let x: Vec<f32> = (0..4).map(|_| rng.normal() as f32).collect();
            let y =
                x.iter().zip(truth).map(|(a, b)| a * b).sum::<f32>() + 0.05 * rng.normal() as f32;
            xs.push(x);
            ys.push(y);
        }
        Ok((
            Regression {
                w,
                xs,
                ys,
                order: Vec::new(),
                cursor: 0,
                epoch: 0,
                batch: 5,
            },
            store,
        ))
    }
}

impl Task for Regression {
    type Batch = (Tensor, Tensor);

    fn start_epoch(&mut self, epoch: usize) -> TaskResult<()> {
        self.epoch = epoch;
        self.order = (0..self.xs.len()).collect();
        SplitMix64::new(100 + epoch as u64).shuffle(&mut self.order);
        self.cursor = 0;
        Ok(())
    }

    fn next_batch(&mut self) -> TaskResult<Option<Self::Batch>> {
        if self.cursor >= self.order.len() {
            return Ok(None);
        }
        let idx = &self.order[self.cursor..(self.cursor + self.batch).min(self.order.len())];
        self.cursor += idx.len();
        let x: Vec<f32> = idx.iter().flat_map(|&i| self.xs[i].clone()).collect();
        let y: Vec<f32> = idx.iter().map(|&i| self.ys[i]).collect();
        Ok(Some((
            Tensor::from_vec(x, (idx.len(), 4), &Device::Cpu)?,
            Tensor::from_vec(y, (idx.len(), 1), &Device::Cpu)?,
        )))
    }

    fn counts(&self, b: &Self::Batch) -> (usize, usize) {
        let n = b.0.dim(0).unwrap_or(0);
        (n, n)
    }

    fn summed_loss(&mut self, b: &Self::Batch, ctx: &StepCtx) -> TaskResult<Tensor> {
        // Dropout from the step's seed: a resumed run must draw the same masks.
        let mut rng = SplitMix64::new(ctx.dropout_seed);
        let mask: Vec<f32> = (0..b.0.elem_count())
            .map(|_| if rng.uniform() < 0.9 { 1.0 / 0.9 } else { 0.0 })
            .collect();
        let x = (&b.0 * Tensor::from_vec(mask, b.0.shape(), &Device::Cpu)?)?;
        let pred = x
            .to_dtype(DType::BF16)?
            .matmul(&self.w)?
            .to_dtype(DType::F32)?;
        Ok((pred - &b.1)?.sqr()?.sum_all()?)
    }

    fn evaluate(&mut self, _step: u64, _l: &mut Ledger) -> TaskResult<Vec<(String, f64)>> {
        let w = self
            .w
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok(vec![("w0".into(), w[0] as f64)])
    }

    fn save_model(&self, dir: &Path) -> TaskResult<()> {
        ft_params::fs::save_safetensors(
            &[("w".into(), self.w.clone())],
            &dir.join("model.safetensors"),
        )?;
        Ok(())
    }

    fn data_state(&self) -> serde_json::Value {
        serde_json::json!({"epoch": self.epoch, "cursor": self.cursor})
    }

    fn restore_data_state(&mut self, s: &serde_json::Value) -> TaskResult<()> {
        let epoch = s["epoch"].as_u64().ok_or("no epoch")? as usize;
        self.start_epoch(epoch)?;
        self.cursor = s["cursor"].as_u64().ok_or("no cursor")? as usize;
        Ok(())
    }
}

fn run(
    out: &Path,
    max_steps: u64,
    resume: Option<PathBuf>,
) -> anyhow::Result<(train::RunSummary, Vec<f32>)> {
    run_at(out, max_steps, resume, 0.3, None)
}

/// [`run`] at peak learning rate `lr`, keeping the best checkpoint by `best`.
fn run_at(
    out: &Path,
    max_steps: u64,
    resume: Option<PathBuf>,
    lr: f64,
    best: Option<BestConfig>,
) -> anyhow::Result<(train::RunSummary, Vec<f32>)> {
    let (mut task, store) = Regression::new(resume.as_deref())?;
    let mut opt = MixedOptimizer::new(
        store.trainable()?,
        Precision::parse("bf16")?,
        StatePlacement::WithModel,
        |n| {
            Box::new(AdamW::new(
                n,
                AdamWConfig {
                    weight_decay: 0.01,
                    ..Default::default()
                },
            ))
        },
        Some(1.0),
    )?;
    let cfg = LoopConfig {
        batch_size: 1,
        units: Units::Samples,
        mode: StepMode::new(StepModeRequest {
            micro_batches: 3,
            fused_backward: false,
            checkpointing: false,
            loss_scaling: false,
        })?,
        max_steps,
        schedule: LrSchedule {
            kind: ScheduleKind::Cosine,
            base_lr: lr,
            warmup_steps: 2,
            total_steps: 12,
        },
        seed: 1,
        output_dir: out.to_path_buf(),
        eval_every: 4,
        save_every: 4,
        progress: false,
        resume,
        best,
        max_bad_steps: 3,
        budget: None,
    };
    let mut ledger = Ledger::new(&Device::Cpu);
    let s = train::run(
        &mut task,
        &mut opt,
        &Checkpointer::new(false),
        &mut ledger,
        &cfg,
    )?;
    let w: Vec<f32> = opt.params()[0]
        .as_tensor()
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    let _: Vec<Var> = opt.params().to_vec();
    Ok((s, w))
}

#[test]
fn loss_falls_and_resume_continues_the_same_curve() -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("ft-loop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // 12 steps x 3 micro-batches of 5 over 37 samples: crosses epochs, with a short last step.
    let (full, w_full) = run(&root.join("full"), 12, None)?;
    assert_eq!(full.losses.len(), 12);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    assert!(
        mean(&full.losses[9..]) < 0.4 * mean(&full.losses[..3]),
        "{:?}",
        full.losses
    );

    // The first part runs on past its checkpoint (as an interrupted run does) to step 8.
    let (first, _) = run(&root.join("part"), 8, None)?;
    assert_eq!(first.losses, full.losses[..8].to_vec());
    let ckpt = root.join("part").join("checkpoint-4");
    for f in [
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(ckpt.join(f).is_file(), "{f} missing");
    }
    assert!(!root.join("part").join("checkpoint-4.tmp").exists());
    let (rest, w_rest) = run(&root.join("part"), 12, Some(ckpt))?;
    assert_eq!(
        rest.losses,
        full.losses[4..].to_vec(),
        "resumed curve differs"
    );
    assert_eq!(w_rest, w_full);
    let metrics = std::fs::read_to_string(root.join("part").join("metrics.jsonl"))?;
    let steps = metrics.lines().filter(|l| l.contains("\"loss\"")).count();
    assert_eq!(
        steps, 12,
        "metrics.jsonl keeps the first part up to the checkpoint and appends the rest once"
    );
    assert!(metrics.contains("eval_w0"));
    std::fs::remove_dir_all(&root)?;
    Ok(())
}

/// A diverged run (a learning rate of 1e30: the loss overflows to inf) skips each bad step's
/// update and stops with one error after three in a row, where it used to train on, save NaN
/// checkpoints and exit 0; metrics.jsonl says which steps were skipped, and what was saved is
/// finite.
#[test]
fn a_diverged_run_stops_with_one_error_after_three_bad_steps() -> anyhow::Result<()> {
    let out = std::env::temp_dir().join(format!("ft-loop-diverged-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let e = run_at(&out, 12, None, 1e30, None).unwrap_err().to_string();
    assert!(
        e.contains("diverged") && e.contains("3 steps in a row"),
        "{e}"
    );
    let skipped = train::logged(&out.join("metrics.jsonl"), "non_finite")?
        .iter()
        .filter(|v| v.as_bool() == Some(true))
        .count();
    assert_eq!(skipped, 3, "the three bad steps are logged as skipped");
    // A checkpoint saved between the bad steps holds the last good weights: finite.
    for entry in std::fs::read_dir(&out)? {
        let dir = entry?.path();
        if dir.join("model.safetensors").is_file() {
            let files = SafetensorsFiles::open(&[dir.join("model.safetensors")])?;
            let w = files.load("w", None, DType::F32, &Device::Cpu, false)?;
            let w: Vec<f32> = w.flatten_all()?.to_vec1()?;
            assert!(w.iter().all(|x| x.is_finite()), "{}: {w:?}", dir.display());
        }
    }
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}

/// A resumed run judges its evaluations against the best of the run before the interruption:
/// here the first evaluation is the best (the watched weight only grows), so the best checkpoint
/// stays at step 4 whether or not the run was interrupted at step 4.
#[test]
fn a_resumed_run_keeps_the_best_so_far() -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("ft-loop-best-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let best = || {
        Some(BestConfig {
            metric: "w0".into(),
            higher_is_better: false,
            patience: 0,
        })
    };
    let (full, _) = run_at(&root.join("full"), 12, None, 0.3, best())?;
    run_at(&root.join("part"), 4, None, 0.3, best())?;
    let ckpt = root.join("part").join("checkpoint-4");
    let (resumed, _) = run_at(&root.join("part"), 12, Some(ckpt), 0.3, best())?;
    let value = |s: &train::RunSummary| s.best.as_ref().map(|b| b.0);
    assert!(value(&full).is_some());
    assert_eq!(
        value(&resumed),
        value(&full),
        "the best value after a resume"
    );
    let state = |dir: &Path| -> anyhow::Result<serde_json::Value> {
        let t = std::fs::read_to_string(dir.join("best/trainer_state.json"))?;
        Ok(serde_json::from_str(&t)?)
    };
    assert_eq!(
        state(&root.join("part"))?["global_step"],
        state(&root.join("full"))?["global_step"],
        "best/ is the same step's checkpoint"
    );
    std::fs::remove_dir_all(&root)?;
    Ok(())
}

/// A checkpoint that would resume otherwise is refused by name: an optimizer state tensor
/// missing from optimizer.safetensors (it would restart from zero), a step that is not a count,
/// an out-of-memory split that is not one.
#[test]
fn a_checkpoint_missing_state_or_with_a_bad_step_is_refused() -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("ft-loop-partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    run(&root.join("a"), 4, None)?;
    let ckpt = root.join("a").join("checkpoint-4");
    // Drop one moment from the optimizer file.
    let opt = ckpt.join("optimizer.safetensors");
    let files = SafetensorsFiles::open(std::slice::from_ref(&opt))?;
    let mut kept = Vec::new();
    for name in files.names().map(|n| n.to_string()).collect::<Vec<_>>() {
        if name != "exp_avg_sq.0" {
            kept.push((
                name.clone(),
                files.load(&name, None, DType::F32, &Device::Cpu, false)?,
            ));
        }
    }
    drop(files);
    ft_params::fs::save_safetensors(&kept, &opt)?;
    let e = run(&root.join("b"), 8, Some(ckpt.clone()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("exp_avg_sq.0") && e.contains("optimizer.safetensors"),
        "{e}"
    );
    // A negative step.
    run(&root.join("c"), 4, None)?;
    let ckpt = root.join("c").join("checkpoint-4");
    let state = ckpt.join("trainer_state.json");
    let text =
        std::fs::read_to_string(&state)?.replace("\"global_step\": 4", "\"global_step\": -5");
    std::fs::write(&state, text)?;
    let e = run(&root.join("d"), 8, Some(ckpt.clone()))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("global_step") && e.contains("trainer_state.json"),
        "{e}"
    );
    // An out-of-memory split that is not two counts.
    let text = std::fs::read_to_string(&state)?
        .replace("\"global_step\": -5", "\"global_step\": 4")
        .replace("\"oom_split\": null", "\"oom_split\": {\"halvings\": -1}");
    std::fs::write(&state, text)?;
    let e = run(&root.join("e"), 8, Some(ckpt)).unwrap_err().to_string();
    assert!(
        e.contains("oom_split") && e.contains("trainer_state.json"),
        "{e}"
    );
    std::fs::remove_dir_all(&root)?;
    Ok(())
}
