//! Parity with transformers (fixtures from scripts/t5_parity.py): forward logits, every step-0
//! gradient, and the loss of 5 AdamW steps at batch 8 and as 2 x 4 accumulation, through the
//! same setup and loop the binary runs.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use clap::Parser;
use ft_models::dropout::DropoutCtx;
use ft_params::checkpoint::Checkpointer;
use ft_params::weights::SafetensorsFiles;
use ft_trainer::scratch::Scratch;
use t5_ft::cli::Args;
use t5_ft::run::setup;

fn fixture(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/t5_tiny")
        .join(variant)
}

fn args(variant: &str, out: &Path, batch: usize, accum: usize, extra: &[&str]) -> Args {
    let dir = fixture(variant);
    let mut v: Vec<String> = vec![
        "t5-ft".into(),
        "--model".into(),
        dir.display().to_string(),
        "--train-file".into(),
        dir.join("train.jsonl").display().to_string(),
        "--output-dir".into(),
        out.display().to_string(),
        "--batch-size".into(),
        batch.to_string(),
        "--accum".into(),
        accum.to_string(),
        "--lr".into(),
        "1e-3".into(),
        "--weight-decay".into(),
        "0.01".into(),
        "--max-grad-norm".into(),
        "0".into(),
        "--max-steps".into(),
        "5".into(),
        "--precision".into(),
        "f32".into(),
        "--quiet".into(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    Args::parse_from(v)
}

fn expected(variant: &str) -> anyhow::Result<serde_json::Value> {
    let text = std::fs::read_to_string(fixture(variant).join("expected.json"))?;
    Ok(serde_json::from_str(&text)?)
}

fn rel_err(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
    Ok(diff / scale)
}

fn tmp(tag: &str) -> Scratch {
    Scratch::new(&format!("t5-parity-{tag}"))
}

fn check_forward_and_grads(variant: &str) -> anyhow::Result<()> {
    let out = tmp(&format!("grad-{variant}"));
    let s = setup(&args(variant, &out, 8, 1, &[]))?;
    // The fixture's batch is the file in order; read it directly (no shuffle).
    let examples = s.task.train.read(&(0..8).collect::<Vec<_>>())?;
    let batch = s.task.collator.collate(&examples, &Device::Cpu)?;
    let ck = Checkpointer::new(false);
    let logits = s.task.model.forward(&batch, &DropoutCtx::eval(), &ck)?;
    let want = SafetensorsFiles::open(&[fixture(variant).join("logits.safetensors")])?.load(
        "logits",
        None,
        DType::F32,
        &Device::Cpu,
        false,
    )?;
    let e = rel_err(&logits, &want)?;
    assert!(e < 1e-4, "{variant}: logits differ by {e} relative");

    let loss =
        (s.task.model.summed_loss(&batch, &DropoutCtx::eval(), &ck)? / batch.label_tokens as f64)?;
    let params = s.optimizer.params().to_vec();
    let grads = ck.gradients(&loss, &params)?;
    let want = SafetensorsFiles::open(&[fixture(variant).join("grads.safetensors")])?;
    let mut checked = 0;
    for (name, g) in s.optimizer.names().iter().zip(&grads) {
        let g = g
            .as_ref()
            .unwrap_or_else(|| panic!("{variant}: `{name}` got no gradient"));
        let w = want.load(name, Some(g.dims()), DType::F32, &Device::Cpu, false)?;
        let e = rel_err(g, &w)?;
        assert!(
            e < 1e-4,
            "{variant}: gradient of `{name}` differs by {e} relative"
        );
        checked += 1;
    }
    assert_eq!(
        checked,
        want.names().count(),
        "{variant}: every reference gradient is checked"
    );
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}

fn check_losses(variant: &str, batch: usize, accum: usize, key: &str) -> anyhow::Result<()> {
    let out = tmp(&format!("loss-{variant}-{accum}"));
    let mut s = setup(&args(variant, &out, batch, accum, &[]))?;
    let summary = s.train()?;
    let exp = expected(variant)?;
    let want: Vec<f64> = exp[key]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
        .unwrap_or_default();
    assert_eq!(summary.losses.len(), want.len());
    for (i, (a, b)) in summary.losses.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() / b.abs() < 1e-4,
            "{variant} {key} step {i}: {a} vs {b}"
        );
    }
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}

#[test]
fn flan_forward_and_every_gradient_match_transformers() -> anyhow::Result<()> {
    check_forward_and_grads("flan")
}

#[test]
fn tied_relu_forward_and_every_gradient_match_transformers() -> anyhow::Result<()> {
    check_forward_and_grads("relu_tied")
}

/// Trains the flan fixture, then leaves its checkpoint with the logits of the fixture batch in
/// `$TMPDIR/t5-ft-parity-saved` for `scripts/t5_parity.py check-saved` (transformers must load it
/// and reproduce the logits).
#[test]
fn saved_checkpoint_is_left_for_the_transformers_check() -> anyhow::Result<()> {
    let out = tmp("saved");
    let mut s = setup(&args("flan", &out, 8, 1, &[]))?;
    let summary = s.train()?;
    let dir = summary.final_dir.expect("final checkpoint");
    let examples = s.task.train.read(&(0..8).collect::<Vec<_>>())?;
    let batch = s.task.collator.collate(&examples, &Device::Cpu)?;
    let logits = s
        .task
        .model
        .forward(&batch, &DropoutCtx::eval(), &Checkpointer::new(false))?;
    ft_params::fs::save_safetensors(
        &[("logits".into(), logits)],
        &dir.join("logits.safetensors"),
    )?;
    let keep = std::env::temp_dir().join("t5-ft-parity-saved");
    let _ = std::fs::remove_dir_all(&keep);
    std::fs::rename(&dir, &keep)?;
    assert!(keep.join("model.safetensors").is_file());
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}

#[test]
fn adamw_losses_match_transformers_at_batch_8() -> anyhow::Result<()> {
    check_losses("flan", 8, 1, "losses_batch8")?;
    check_losses("relu_tied", 8, 1, "losses_batch8")
}

#[test]
fn accumulation_2x4_matches_batch_8() -> anyhow::Result<()> {
    check_losses("flan", 4, 2, "losses_accum_2x4")
}
