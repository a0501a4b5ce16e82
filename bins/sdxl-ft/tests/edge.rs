//! Values at the edge of what sdxl-ft takes: each one works or is refused by name, none panics
//! or reports a figure it did not measure.

mod common;

use common::{args, tmp};
use sdxl_ft::run::setup;

/// `--bucket-step 0` is refused by name (it gave a shape error); `--eval-images 0` evaluates
/// without a validation loss (it printed "eval loss: 0.0000").
#[test]
fn bucket_step_zero_and_no_validation_images() -> anyhow::Result<()> {
    let out = tmp("edge-flags");
    let e = setup(&args(
        &out.join("a"),
        &["--aspect-buckets", "--bucket-step", "0"],
    )?)
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(e.contains("--bucket-step"), "{e}");
    let mut a = args(&out.join("b"), &["--max-steps", "1"])?;
    a.eval_images = 0;
    let mut s = setup(&a)?;
    let summary = s.train()?;
    let keys: Vec<&str> = summary.last_eval.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["samples"], "no loss without validation images");
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}

/// A UNet config whose head count is 0 (or does not divide a level's channels) is an error
/// naming unet/config.json, where it divided by zero.
#[test]
fn a_unet_config_with_zero_heads_names_the_file() -> anyhow::Result<()> {
    let out = tmp("edge-heads");
    let model = out.join("model");
    sdxl_ft::demo::write_model(&model, 5)?;
    let path = model.join("unet/config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let levels = cfg["block_out_channels"]
        .as_array()
        .map(|a| a.len())
        .unwrap_or(2);
    for bad in [serde_json::json!(vec![0; levels]), serde_json::json!(7)] {
        cfg["attention_head_dim"] = bad.clone();
        std::fs::write(&path, cfg.to_string())?;
        let e = sdxl_ft::pipeline::Pipeline::open(&model.display().to_string(), None)
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        assert!(
            e.contains("unet/config.json") && e.contains("attention heads"),
            "{bad}: {e}"
        );
    }
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}

/// The demo's VAE reconstructs shape images (its samples show shapes, not coloured noise), and
/// the fit that made it lowers the reconstruction error from a random VAE's.
#[test]
fn the_demo_vae_reconstructs_shapes() -> anyhow::Result<()> {
    use sdxl_ft::demo::vae_fit;
    let out = tmp("demo-vae");
    let model = out.join("model");
    sdxl_ft::demo::write_model(&model, 5)?;
    let psnr = vae_fit::preview(&model.join("vae"), 8, &out.join("preview.png"))?;
    assert!(psnr > 25.0, "demo VAE reconstruction PSNR {psnr:.1} dB");
    // A short fit from random weights: the error falls, and the random start's reconstructions
    // are far from the fitted VAE's.
    let fitted = vae_fit::fit(60, 4, 5e-3, 1, |_, _| {})?;
    let r = fitted.report;
    println!("{r:?}");
    assert!(r.last_mse < 0.5 * r.first_mse, "{r:?}");
    let random = vae_fit::fit(0, 4, 2e-3, 1, |_, _| {})?;
    vae_fit::write(&random, &out.join("random"))?;
    let random_psnr = vae_fit::preview(&out.join("random"), 8, &out.join("random.png"))?;
    assert!(random_psnr < 15.0, "a random VAE: {random_psnr:.1} dB");
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// The MMD's flags are refused by name when they cannot work (one sample, a CLIP model or a
/// held-out folder without samples, a CLIP folder that is not there); with the user's own
/// --data-dir and no --eval-data-dir the first training images stand in as the real set, with
/// pooled-latent features, and `--num-samples 0` still evaluates the metric.
#[test]
fn mmd_flags_and_the_training_set_standing_in_for_held_out_images() -> anyhow::Result<()> {
    let out = tmp("edge-mmd");
    let missing = out.join("no-such-clip").display().to_string();
    for (extra, want) in [
        (&["--eval-mmd-samples", "1"][..], "at least 2"),
        (&["--eval-clip-model", "x"][..], "give --eval-mmd-samples"),
        (&["--eval-data-dir", "x"][..], "give --eval-mmd-samples"),
        (
            &["--eval-mmd-samples", "3", "--eval-clip-model", &missing][..],
            "no-such-clip",
        ),
    ] {
        let e = setup(&args(&out.join("bad"), extra)?)
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        assert!(e.contains(want), "{extra:?}: {e}");
    }
    let images = out.join("images");
    sdxl_ft::demo::write_images(&images, 6, 1)?;
    let data = images.display().to_string();
    let mut a = args(
        &out.join("run"),
        &[
            "--data-dir",
            &data,
            "--eval-mmd-samples",
            "3",
            "--max-steps",
            "1",
        ],
    )?;
    (a.num_samples, a.eval_images) = (0, 0);
    let mut s = setup(&a)?;
    let mmd = s
        .task
        .mmd
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("no MMD"))?;
    assert_eq!((mmd.n, mmd.features()), (3, "latent"));
    assert_eq!(mmd.cache.dir, s.task.cache.dir);
    let summary = s.train()?;
    let keys: Vec<&str> = summary.last_eval.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["kid_latent", "cmmd_latent"]);
    assert!(summary.last_eval.iter().all(|(_, v)| v.is_finite()));
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}
