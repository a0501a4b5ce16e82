//! sdxl-ft as a user runs it, on hostile input: the built binary, its exit status and stderr.
//! Each case was a failure once (issue 17) or must stay fixed: one clear error naming the file,
//! tensor or flag and status 1, never a panic, a stale cache or a silent fallback.

#[path = "../../../tests/hostile/run.rs"]
mod hostile;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use ft_params::weights::SafetensorsFiles;
use hostile::{arg, fresh, run, Ran};

const BIN: &str = env!("CARGO_BIN_EXE_sdxl-ft");

/// A short demo run into `out`: one step, a small evaluation, unless `extra` says otherwise.
fn demo(out: &Path, extra: &[&str]) -> Ran {
    let out = arg(out);
    let mut v = vec!["--demo", "--quiet", "--output-dir", &out];
    for (flag, value) in [
        ("--max-steps", "1"),
        ("--sample-steps", "2"),
        ("--num-samples", "1"),
        ("--eval-images", "4"),
    ] {
        if !extra.contains(&flag) {
            v.extend([flag, value]);
        }
    }
    v.extend_from_slice(extra);
    run(BIN, &v)
}

/// A run on a model folder and an image folder, no demo settings.
fn on(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> Ran {
    let (model, data, out) = (arg(model), arg(data), arg(out));
    let mut v = vec![
        "--model",
        &model,
        "--data-dir",
        &data,
        "--output-dir",
        &out,
        "--quiet",
        "--res",
        "32",
        "--num-samples",
        "0",
    ];
    v.extend_from_slice(extra);
    run(BIN, &v)
}

/// The demo's model and images, written once for the cases that break copies of them.
fn demo_files(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let d = sdxl_ft::demo::write(&dir.join("demo"), 8, 1)?;
    Ok((d.model, d.data))
}

fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        if e.path().is_dir() {
            copy_tree(&e.path(), &to.join(e.file_name()))?;
        } else {
            std::fs::copy(e.path(), to.join(e.file_name()))?;
        }
    }
    Ok(())
}

#[test]
fn broken_models_are_refused_by_file_and_tensor() -> anyhow::Result<()> {
    let dir = fresh("sdxl", "model");
    let (model, data) = demo_files(&dir)?;
    let unet_file = "unet/diffusion_pytorch_model.safetensors";
    // A UNet weight holding NaN names the tensor and the file.
    let nan = dir.join("nan");
    copy_tree(&model, &nan)?;
    let files = SafetensorsFiles::open(&[model.join(unet_file)])?;
    let mut names: Vec<String> = files.names().map(str::to_string).collect();
    names.sort();
    let mut tensors = Vec::new();
    for n in &names {
        tensors.push((
            n.clone(),
            files.load(n, None, DType::F32, &Device::Cpu, false)?,
        ));
    }
    drop(files);
    tensors[0].1 = (tensors[0].1.clone() * f64::NAN)?;
    ft_params::fs::save_safetensors(&tensors, &nan.join(unet_file))?;
    on(&nan, &data, &dir.join("o1"), &["--max-steps", "1"])
        .fails_naming(&[&names[0], "diffusion_pytorch_model.safetensors"]);
    // A truncated UNet file names the file.
    let cut = dir.join("cut");
    copy_tree(&model, &cut)?;
    let bytes = std::fs::read(model.join(unet_file))?;
    std::fs::write(cut.join(unet_file), &bytes[..bytes.len() / 3])?;
    on(&cut, &data, &dir.join("o2"), &["--max-steps", "1"])
        .fails_naming(&["diffusion_pytorch_model.safetensors"]);
    // Zero attention heads are an error naming the config, not a division by zero.
    let heads = dir.join("heads");
    copy_tree(&model, &heads)?;
    let cfg = heads.join("unet/config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg)?)?;
    v["attention_head_dim"] = serde_json::json!([0, 0]);
    std::fs::write(&cfg, v.to_string())?;
    on(&heads, &data, &dir.join("o3"), &["--max-steps", "1"]).fails_naming(&["unet/config.json"]);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn bad_data_and_flags_are_named() -> anyhow::Result<()> {
    let dir = fresh("sdxl", "data");
    let (model, data) = demo_files(&dir)?;
    on(
        &model,
        &dir.join("absent"),
        &dir.join("o"),
        &["--max-steps", "1"],
    )
    .fails_naming(&["absent"]);
    on(&model, &data, &dir.join("o"), &["--epochs", "0"]).fails_naming(&["--epochs"]);
    on(
        &model,
        &data,
        &dir.join("o"),
        &["--max-steps", "1", "--aspect-buckets", "--bucket-step", "0"],
    )
    .fails_naming(&["--bucket-step"]);
    // An image that does not decode is skipped and said, or with --strict-images named.
    let broken = dir.join("broken");
    copy_tree(&data, &broken)?;
    std::fs::write(broken.join("001.png"), b"not a png")?;
    on(&model, &broken, &dir.join("o4"), &["--max-steps", "1"])
        .succeeds()
        .says("skipped 1 unreadable images")
        .says("001.png");
    // `--num-samples 0` (every `on` run) evaluates without samples: it failed at the end of
    // training, "no sample prompts in the cache".
    assert!(!dir.join("o4/samples").exists());
    on(
        &model,
        &broken,
        &dir.join("o5"),
        &["--max-steps", "1", "--strict-images"],
    )
    .fails_naming(&["001.png"]);
    // A malformed metadata.jsonl line names file and line.
    let meta = dir.join("meta");
    copy_tree(&data, &meta)?;
    let text = std::fs::read_to_string(meta.join("metadata.jsonl"))?;
    let mut lines: Vec<&str> = text.lines().collect();
    lines[2] = "{\"file_name\": ";
    std::fs::write(meta.join("metadata.jsonl"), lines.join("\n"))?;
    on(&model, &meta, &dir.join("o6"), &["--max-steps", "1"]).fails_naming(&["metadata.jsonl:3"]);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// A rerun that changes the aspect buckets builds the cache again instead of training on the
/// old square latents; `--eval-images 0` evaluates without a validation loss (it reported 0).
#[test]
fn the_cache_follows_the_buckets_and_no_eval_images_means_no_loss() -> anyhow::Result<()> {
    let dir = fresh("sdxl", "cache");
    demo(&dir, &[]).succeeds().says("cache built");
    demo(&dir, &[]).succeeds().says("cache reused");
    demo(&dir, &["--aspect-buckets"])
        .succeeds()
        .says("cache built");
    let out = dir.join("noeval");
    demo(&out, &["--eval-images", "0"]).succeeds();
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    assert!(!metrics.contains("eval_loss"), "{metrics}");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
