//! sdxl-ft end to end on the bundled tiny pipeline: the cache is reused, resume continues
//! exactly, and bad data or configs get one clear error naming the file and line.

mod common;

use std::path::{Path, PathBuf};

use common::{args, tensors, tmp};
use ft_trainer::train::Binary;
use sdxl_ft::run::setup;

#[test]
fn resume_continues_exactly_and_the_cache_is_reused() -> anyhow::Result<()> {
    let out = tmp("resume");
    let common = [
        "--max-steps",
        "6",
        "--save-every",
        "3",
        "--accum",
        "2",
        "--ema",
        "--ema-decay",
        "0.9",
        "--random-flip",
    ];
    let full = {
        let mut s = setup(&args(&out.join("a"), &common)?)?;
        s.train()?
    };
    // A second run resumes from step 3 with the first run's images and cache folder: its own
    // demo model has the same weights in another folder, so the cache is reused, not rebuilt.
    let cache = out.join("a/cache").display().to_string();
    let images = out.join("a/demo-data/images").display().to_string();
    let ck = out.join("a/checkpoint-3").display().to_string();
    let mut extra = common.to_vec();
    extra.extend_from_slice(&[
        "--resume",
        &ck,
        "--cache-dir",
        &cache,
        "--data-dir",
        &images,
    ]);
    let mut s = setup(&args(&out.join("b"), &extra)?)?;
    assert!(!s.task.cache.built, "the cache is reused");
    let resumed = s.train()?;
    assert_eq!(resumed.losses, full.losses[3..].to_vec());
    // A changed caption changes the cache's key: it is built again, not reused.
    let meta = out.join("a/demo-data/images/metadata.jsonl");
    let text = std::fs::read_to_string(&meta)?;
    let last = text.lines().last().unwrap_or_default().to_string();
    std::fs::write(
        &meta,
        text.replace(&last, &last.replace("background", "backdrop")),
    )?;
    let c = setup(&args(
        &out.join("c"),
        &[
            "--cache-dir",
            &cache,
            "--data-dir",
            &images,
            "--max-steps",
            "1",
        ],
    )?)?;
    assert!(c.task.cache.built, "a changed caption rebuilds the cache");
    drop(c);
    // So does a change of aspect buckets (on, or another step): the latents are cut otherwise.
    let again = |tag: &str, extra: &[&str]| -> anyhow::Result<bool> {
        let mut v = vec![
            "--cache-dir",
            &cache,
            "--data-dir",
            &images,
            "--max-steps",
            "1",
        ];
        v.extend_from_slice(extra);
        Ok(setup(&args(&out.join(tag), &v)?)?.task.cache.built)
    };
    assert!(!again("d", &[])?, "unchanged: reused");
    assert!(again("e", &["--aspect-buckets"])?, "buckets on: rebuilt");
    assert!(
        !again("f", &["--aspect-buckets"])?,
        "the same buckets: reused"
    );
    assert!(
        again("g", &["--aspect-buckets", "--bucket-step", "16"])?,
        "another bucket step: rebuilt"
    );
    for f in [
        "unet/diffusion_pytorch_model.safetensors",
        "unet_ema/diffusion_pytorch_model.safetensors",
    ] {
        assert_eq!(
            tensors(&out.join("a/checkpoint-6").join(f))?,
            tensors(&out.join("b/checkpoint-6").join(f))?,
            "{f}"
        );
    }
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// Copies the demo images into a fresh folder so a test can damage them.
fn demo_images(out: &Path) -> anyhow::Result<PathBuf> {
    let d = out.join("images");
    sdxl_ft::demo::write_images(&d, 8, 1)?;
    Ok(d)
}

#[test]
fn unreadable_images_are_skipped_and_counted_or_stop_the_run() -> anyhow::Result<()> {
    let out = tmp("badimg");
    let images = demo_images(&out)?;
    std::fs::write(images.join("003.png"), b"not a png")?;
    let data = images.display().to_string();
    let s = setup(&args(
        &out.join("run"),
        &["--data-dir", &data, "--max-steps", "1"],
    )?)?;
    let m = &s.task.cache.manifest;
    assert_eq!((m.entries.len(), m.skipped.len()), (7, 1));
    assert!(m.skipped[0].0.ends_with("003.png"));
    let e = setup(&args(
        &out.join("strict"),
        &["--data-dir", &data, "--strict-images"],
    )?)
    .err()
    .map(|e| format!("{e:#}"))
    .unwrap_or_default();
    assert!(e.contains("003.png") && e.contains("strict"), "{e}");
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

#[test]
fn bad_captions_and_configs_name_the_file_and_line() -> anyhow::Result<()> {
    let out = tmp("baddata");
    let images = demo_images(&out)?;
    let data = images.display().to_string();
    let err = |extra: &[&str]| -> String {
        args(&out.join("run"), extra)
            .and_then(|a| setup(&a))
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default()
    };
    let meta = images.join("metadata.jsonl");
    let good = std::fs::read_to_string(&meta)?;
    let mut lines: Vec<&str> = good.lines().collect();
    lines[2] = "{\"file_name\": \"002.png\", \"text\": ";
    std::fs::write(&meta, lines.join("\n"))?;
    let e = err(&["--data-dir", &data]);
    assert!(e.contains("metadata.jsonl:3"), "{e}");
    lines[2] = "{\"file_name\": \"missing.png\", \"text\": \"x\"}";
    std::fs::write(&meta, lines.join("\n"))?;
    let e = err(&["--data-dir", &data]);
    assert!(
        e.contains("metadata.jsonl:3") && e.contains("missing.png"),
        "{e}"
    );
    // Without metadata.jsonl every image needs a .txt caption.
    std::fs::remove_file(&meta)?;
    let e = err(&["--data-dir", &data]);
    assert!(e.contains("000.png") && e.contains("000.txt"), "{e}");
    // A UNet whose cross-attention width does not match the text encoders.
    let model = out.join("model");
    sdxl_ft::demo::write_model(&model, 1)?;
    let cfg_path = model.join("unet/config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path)?)?;
    cfg["cross_attention_dim"] = 48.into();
    std::fs::write(&cfg_path, cfg.to_string())?;
    let e = sdxl_ft::pipeline::Pipeline::open(&model.display().to_string(), None)
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(
        e.contains("unet/config.json") && e.contains("cross_attention_dim"),
        "{e}"
    );
    assert!(err(&["--res", "30"]).contains("--res"));
    assert!(err(&["--crop", "left"]).contains("--crop"));
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

#[test]
fn shipped_configs_parse_and_validate() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let full = root.join("full_sdxl.toml").display().to_string();
    let a: sdxl_ft::cli::Args = ft_trainer::train::config::parse_from(
        ["sdxl-ft", "--config", &full, "--data-dir", "images"],
        |a: &sdxl_ft::cli::Args| a.common.config.clone(),
    )?;
    a.validate()?;
    assert_eq!((a.res, a.common.batch_size, a.common.accum), (128, 1, 16));
    assert!(a.common.gradient_checkpointing && a.ema);
    // Seed 001's 24 GB card needs the optimizer state on the host.
    assert!(a.common.offload_optimizer);
    assert_eq!(a.common.precision.as_deref(), Some("bf16"));
    assert_eq!(a.model(), Some("stabilityai/stable-diffusion-xl-base-1.0"));
    let demo = root.join("sdxl_demo.toml").display().to_string();
    let d: sdxl_ft::cli::Args = ft_trainer::train::config::parse_from(
        ["sdxl-ft", "--config", &demo, "--max-steps", "3"],
        |a: &sdxl_ft::cli::Args| a.common.config.clone(),
    )?;
    d.validate()?;
    assert!(d.common.demo);
    assert_eq!(d.common.max_steps, Some(3), "flags override the file");
    Ok(())
}

#[test]
fn bf16_weights_with_fp32_masters_and_checkpointing_train() -> anyhow::Result<()> {
    let out = tmp("bf16");
    let mut s = setup(&args(
        &out,
        &[
            "--precision",
            "bf16",
            "--gradient-checkpointing",
            "--max-steps",
            "12",
            "--ema",
        ],
    )?)?;
    assert_eq!(s.task.dtype, candle_core::DType::BF16);
    assert!(!s.optimizer.masters().is_empty(), "fp32 master weights");
    let before = s.task.validation_loss()?;
    let summary = s.train()?;
    let after = s.task.validation_loss()?;
    assert!(after < before, "validation loss {before:.4} -> {after:.4}");
    let dir = summary.final_dir.unwrap_or_default();
    let unet = ft_params::weights::SafetensorsFiles::open(&[
        dir.join("unet/diffusion_pytorch_model.safetensors")
    ])?;
    let name = unet.names().next().unwrap_or_default().to_string();
    assert_eq!(
        unet.meta(&name).map(|m| format!("{:?}", m.dtype)),
        Some("BF16".to_string()),
        "the UNet is saved in its training dtype"
    );
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

#[test]
fn aspect_buckets_cut_images_to_their_nearest_ratio_and_batch_per_bucket() -> anyhow::Result<()> {
    use ft_trainer::train::Task;
    let buckets = sdxl_ft::data::buckets(32, 8);
    assert!(buckets.contains(&(32, 32)) && buckets.contains(&(40, 24)));
    assert!(buckets.iter().all(|(h, w)| h * w <= 32 * 32));
    assert_eq!(sdxl_ft::data::nearest_bucket((64, 48), &buckets), (40, 24));
    assert_eq!(sdxl_ft::data::nearest_bucket((50, 50), &buckets), (32, 32));

    let out = tmp("buckets");
    let mut s = setup(&args(&out, &["--aspect-buckets", "--max-steps", "4"])?)?;
    let entries = s.task.cache.manifest.entries.clone();
    let sizes: std::collections::BTreeSet<[usize; 2]> = entries.iter().map(|e| e.size).collect();
    assert!(sizes.len() > 1, "several buckets: {sizes:?}");
    for (i, e) in entries.iter().enumerate() {
        assert_eq!(e.latent[1] * 4, e.size[0], "latent height of {}", e.file);
        let ids = s.task.cache.time_ids(i, false);
        assert_eq!((ids[4], ids[5]), (e.size[0] as f32, e.size[1] as f32));
    }
    let mut seen = 0;
    s.task.start_epoch(0).map_err(|e| anyhow::anyhow!("{e}"))?;
    while let Some(b) = s.task.next_batch().map_err(|e| anyhow::anyhow!("{e}"))? {
        assert!(b.iter().all(|&i| entries[i].size == entries[b[0]].size));
        seen += b.len();
    }
    assert_eq!(seen, entries.len(), "every image once per epoch");
    s.task.start_epoch(0).map_err(|e| anyhow::anyhow!("{e}"))?;
    let summary = s.train()?;
    assert_eq!(summary.steps, 4);
    assert!(summary.losses.iter().all(|l| l.is_finite()));
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// The demo pipeline under `out` with the full SDXL UNet config (`configs/sdxl/unet_config.json`)
/// and text encoders as wide as SDXL's: what `--plan` reads of `stabilityai/...-base-1.0`
/// (configs, no weights). Returns the pipeline folder.
fn full_unet_pipeline(out: &Path) -> anyhow::Result<PathBuf> {
    let demo = sdxl_ft::demo::write(&out.join("demo-data"), 2, 1)?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    std::fs::copy(
        root.join("sdxl/unet_config.json"),
        demo.model.join("unet/config.json"),
    )?;
    // Text encoders as wide as SDXL's (CLIP-L 768, OpenCLIP-G 1280 with its projection), so the
    // pipeline's consistency checks hold; their weights are never read.
    for (dir, hidden) in [("text_encoder", 768), ("text_encoder_2", 1280)] {
        let path = demo.model.join(dir).join("config.json");
        let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        cfg["hidden_size"] = hidden.into();
        cfg["projection_dim"] = hidden.into();
        std::fs::write(&path, cfg.to_string())?;
    }
    // A VAE with SDXL's four levels: latents are the image over 8 (the demo's has three).
    let path = demo.model.join("vae/config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    cfg["block_out_channels"] = serde_json::json!([128, 256, 512, 512]);
    std::fs::write(&path, cfg.to_string())?;
    Ok(demo.model)
}

/// `--plan` with seed 001's preset on the full SDXL UNet config (the demo pipeline with the real
/// `unet/config.json` put in; no weights read, no GPU opened): what the GPU and the host hold.
#[test]
fn plan_of_the_full_unet_with_the_seed_preset() -> anyhow::Result<()> {
    let out = tmp("plan");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let model = full_unet_pipeline(&out)?.display().to_string();
    // `sdxl-ft --config configs/NAME --model <the folder above> --plan`.
    let preset = |name: &str| -> anyhow::Result<sdxl_ft::cli::Args> {
        let path = root.join(name).display().to_string();
        Ok(ft_trainer::train::config::parse_from(
            ["sdxl-ft", "--config", &path, "--model", &model, "--plan"],
            |a: &sdxl_ft::cli::Args| a.common.config.clone(),
        )?)
    };
    let a = preset("full_sdxl.toml")?;
    let plan = sdxl_ft::run::plan(&a)?;
    eprintln!("{}", plan.table());
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    assert_eq!(plan.params, 2_567_463_684);
    // 17 ResNets and 70 transformer layers are checkpointed: under --fused-backward with
    // clipping, a step reads norms back once per segment and once for the rest, 88 times, not
    // once for each of the 1,680 trainable tensors.
    let (pb, store, _) = a.common.shapes_builder()?;
    let cfg = ft_models::unet::UNetConfig::from_file(&root.join("sdxl/unet_config.json"))?;
    assert_eq!(
        ft_models::unet::UNet::new(&pb, &cfg)?.segments().len(),
        17 + 70
    );
    assert_eq!(store.shapes(true).len(), 1680);
    // Weights and one block's gradients on the GPU (each segment's go to the host's fp32 sums as
    // its backward ends); sums, masters, moments and the EMA (38.26 + 9.56 GiB) on the host.
    assert!(
        (gib(plan.state_device_bytes()) - 4.97).abs() < 0.01,
        "{}",
        plan.table()
    );
    assert!((gib(plan.host_bytes()) - 47.82).abs() < 0.01);
    // Seed 001's five GPUs (`--plan --plan-ranks 5`), the README's table: each rank keeps its
    // share of the EMA (`ema`); the optimizer on the host or beside the model (`offload`); the
    // fused backward or not (`fused`).
    let five_with = |zero: u8, ema: bool, offload: bool, fused: bool| {
        let mut r = a.clone();
        r.common.plan_ranks = Some(5);
        r.common.zero = zero;
        r.ema = ema;
        r.common.offload_optimizer = offload;
        r.common.fused_backward = fused;
        let p = sdxl_ft::run::plan(&r);
        if let Ok(p) = &p {
            eprintln!("{}", p.table());
        }
        p
    };
    let five = |zero, ema, offload| five_with(zero, ema, offload, false);
    // Without ZeRO each rank holds what one process holds but the EMA: 38.26 GiB of host
    // memory, and a fifth of the EMA (1.91 GiB) beside it.
    assert!((gib(five(0, false, true)?.host_bytes()) - 38.37).abs() < 0.01);
    assert!((gib(five(0, true, true)?.host_bytes()) - 40.28).abs() < 0.01);
    // Under ZeRO-2 each rank keeps a fifth of the moments, gradient sums, masters and EMA. With
    // the UNet in checkpoint segments each segment's gradients go to their owners as its
    // backward ends: the GPU holds the weights and one block's gradients (as under the fused
    // backward), 4.97 GiB where one process holds 9.56, with the global norm's clipping.
    let z2 = five(2, true, true)?;
    assert!(
        (gib(z2.state_device_bytes()) - 4.97).abs() < 0.01,
        "{}",
        z2.table()
    );
    let share = |what: &str| {
        z2.rows
            .iter()
            .find(|r| r.component.contains(what))
            .map_or(0.0, |r| gib(r.bytes))
    };
    assert!(
        (share("AdamW moments") - 19.13 / 5.0).abs() < 0.02,
        "{}",
        z2.table()
    );
    for fifth in ["gradient sums", "master weights", "EMA"] {
        assert!((share(fifth) - 9.56 / 5.0).abs() < 0.01, "{fifth}");
    }
    // And what each micro-batch's sums over the ranks hold in flight (the largest tensor, 112.5
    // MiB in fp32, and its fp32 copy from bf16): 9.78 GiB.
    let in_flight = |p: &ft_trainer::train::plan::StatePlan| {
        p.rows
            .iter()
            .find(|r| r.component.contains("in flight"))
            .map_or(0.0, |r| gib(r.bytes))
    };
    assert!((in_flight(&z2) - 225.0 / 1024.0).abs() < 0.001);
    assert!((gib(z2.host_bytes()) - 9.78).abs() < 0.01);
    // Without the EMA: 7.87 GiB of host memory a rank.
    assert!((gib(five(2, false, true)?.host_bytes()) - 7.87).abs() < 0.01);
    // ZeRO-2 with the fused backward: a GPU holds the weights and one block's gradients; the
    // step's 15 earlier micro-batches go to their owners, whose fp32 sums are a fifth, and the
    // last one's rounds hold a segment's sums at a time on the host (the largest 225 MiB, as
    // the plain backward's): 9.78 GiB.
    let fused = five_with(2, true, true, true)?;
    assert!((in_flight(&fused) - 225.0 / 1024.0).abs() < 0.001);
    assert!(
        (gib(fused.state_device_bytes()) - 4.97).abs() < 0.01,
        "{}",
        fused.table()
    );
    assert!(
        (gib(fused.host_bytes()) - 9.78).abs() < 0.01,
        "{}",
        fused.table()
    );
    // Without the EMA and the offload, ZeRO-2 holds each rank's share beside its GPU: 12.63
    // GiB of model states, which a 16 GB card holds, where one process needs 47.82.
    let beside = five(2, false, false)?;
    assert!(
        (gib(beside.state_device_bytes()) - 12.63).abs() < 0.01,
        "{}",
        beside.table()
    );
    // The sums over the ranks go through host memory unless the build has NCCL.
    let through_host = if cfg!(feature = "nccl") {
        0.0
    } else {
        225.0 / 1024.0
    };
    assert!((gib(beside.host_bytes()) - through_host).abs() < 0.001);
    // 8-bit moments beside the model (the CUDA kernel's layout): 14.3 GiB less than 32-bit
    // AdamW's 43.2 on the GPU, the EMA still on the host.
    let mut q8 = a.clone();
    q8.common.offload_optimizer = false;
    q8.common.optim = "adamw8bit".into();
    let q8 = sdxl_ft::run::plan(&q8)?;
    eprintln!("{}", q8.table());
    assert!(
        (gib(q8.state_device_bytes()) - 28.97).abs() < 0.01,
        "{}",
        q8.table()
    );
    assert!((gib(q8.host_bytes()) - 9.56).abs() < 0.01);
    // kohya's recipe on seed 001's 24 GB card: Adafactor (factored second moments), one
    // micro-batch a step (no fp32 sums), state beside the model: weights, gradients and fp32
    // masters, 19.1 GiB, and 0.9 GiB of optimizer state (transformers factors a 3x3 conv
    // kernel over its last two dims, so convolutions keep two thirds of a full moment).
    let mut af = a.clone();
    af.common.offload_optimizer = false;
    af.common.optim = "adafactor".into();
    af.common.accum = 1;
    let af = sdxl_ft::run::plan(&af)?;
    eprintln!("{}", af.table());
    assert!(
        (gib(af.state_device_bytes()) - 20.04).abs() < 0.01,
        "{}",
        af.table()
    );
    // configs/sdxl_24gb.toml, with --full-bf16 (no fp32 masters, stochastic rounding) and the
    // fused backward pass: 5.88 GiB, nothing on the host. The gradients alive at once are those
    // outside the checkpoint segments (103 MiB) and of the largest segment (94 MiB: an up
    // block's ResNet with 2,560 input channels), not the UNet's 4.78 GiB; without the fused
    // backward the same recipe holds 10.47 GiB.
    let pure = preset("sdxl_24gb.toml")?;
    pure.validate()?;
    assert!(pure.common.full_bf16 && pure.common.accum == 1 && pure.common.fused_backward);
    let mut unfused = pure.clone();
    unfused.common.fused_backward = false;
    let unfused = sdxl_ft::run::plan(&unfused)?;
    let pure = sdxl_ft::run::plan(&pure)?;
    assert_eq!(pure.host_bytes(), 0);
    eprintln!("{}", pure.table());
    assert!(
        (gib(pure.state_device_bytes()) - 5.88).abs() < 0.01,
        "{}",
        pure.table()
    );
    assert!(
        (gib(unfused.state_device_bytes()) - 10.47).abs() < 0.01,
        "{}",
        unfused.table()
    );
    // configs/sdxl_adamw_accum.toml: batch 1 x accumulation 16 with 8-bit AdamW, no masters,
    // the fused backward with accumulation: weights, fp32 sums, 8-bit moments and the
    // gradients alive at once, all on the GPU. Plain accumulation in segments holds the same
    // (each segment's gradients added to the sums as its backward ends), with the global
    // norm's clipping.
    let accum = preset("sdxl_adamw_accum.toml")?;
    accum.validate()?;
    assert!(accum.common.accum == 16 && accum.common.fused_backward && accum.common.full_bf16);
    let mut plain_accum = accum.clone();
    plain_accum.common.fused_backward = false;
    let (accum, plain_accum) = (
        sdxl_ft::run::plan(&accum)?,
        sdxl_ft::run::plan(&plain_accum)?,
    );
    eprintln!("{}", accum.table());
    assert_eq!(accum.host_bytes(), 0);
    assert!(
        (gib(accum.state_device_bytes()) - 19.40).abs() < 0.01,
        "{}",
        accum.table()
    );
    assert!(
        (gib(plain_accum.state_device_bytes()) - 19.40).abs() < 0.01,
        "{}",
        plain_accum.table()
    );
    // Its activations of one bf16 micro-batch, by strategy, at 128 and 1024 px (the UNet's
    // formulas, tested against real graphs in ft-models' tests/activations.rs; the GPU's fused
    // attention keeps no scores).
    let mut table =
        String::from("| px | strategy | kept | + recompute | host | total on the GPU |\n");
    for res in [128, 1024] {
        let mut kept_by = Vec::new();
        for strategy in ["none", "blocks", "every:2", "full", "full-host"] {
            let mut a = preset("sdxl_adamw_accum.toml")?;
            a.res = res;
            a.common.checkpointing = Some(strategy.into());
            // (The fused backward needs segments.)
            a.common.fused_backward = strategy != "none";
            let p = sdxl_ft::run::plan(&a)?;
            let held = p
                .activations()
                .ok_or_else(|| anyhow::anyhow!("no activations in the plan"))?;
            table += &format!(
                "| {res} | {strategy} | {} | {:.2} GiB |\n",
                held.cells(),
                gib(p.device_bytes())
            );
            assert_eq!(p.activation_device_bytes(), held.peak());
            kept_by.push(held.kept);
        }
        // blocks keeps a copy of each segment's output beside its graph; every:2 half the
        // graphs; full only what lies between segments, less under full-host.
        let [none, blocks, every2, full, full_host] = kept_by[..] else {
            anyhow::bail!("five strategies")
        };
        assert!(full_host < full && full < every2 && every2 < none && none < blocks);
        // The README's figures at 1024 px.
        if res == 1024 {
            assert!((gib(none) - 10.01).abs() < 0.01, "{table}");
            assert!((gib(full) * 1024.0 - 857.28).abs() < 0.01, "{table}");
        }
    }
    eprintln!("{table}");
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// `--offload-optimizer` with bf16 weights, accumulation and the host EMA (which then reads the
/// host masters): the same losses, evaluation and EMA as with the state beside the model.
#[test]
fn offloaded_optimizer_trains_the_unet_the_same() -> anyhow::Result<()> {
    let run = |tag: &str, extra: &[&str]| -> anyhow::Result<ft_trainer::train::RunSummary> {
        let out = tmp(tag);
        let mut flags = vec![
            "--precision",
            "bf16",
            "--accum",
            "2",
            "--max-steps",
            "4",
            "--ema",
            "--ema-every",
            "1",
            "--eval-every",
            "4",
        ];
        flags.extend_from_slice(extra);
        let mut s = setup(&args(&out, &flags)?)?;
        let summary = s.train()?;
        std::fs::remove_dir_all(&out)?;
        Ok(summary)
    };
    let near = run("near", &[])?;
    let host = run("host", &["--offload-optimizer"])?;
    assert!(
        near.losses.len() == 4 && !near.last_eval.is_empty(),
        "four steps and an evaluation"
    );
    assert_eq!(host.losses, near.losses, "losses");
    assert_eq!(
        host.last_eval, near.last_eval,
        "evaluation (EMA weights swapped in)"
    );
    Ok(())
}

/// `--fused-backward` on the UNet: every parameter of a checkpoint segment (ResNet blocks and
/// transformer layers) is updated during the backward, and `UNet::segments`, which the plan
/// bounds the gradients by, lists exactly those: the distinct trainable tensors it names are
/// the count each step reports as updated early. The plan then holds the gradients outside the
/// segments and of the largest one, not the whole model's.
#[test]
fn fused_backward_updates_what_the_unet_lists_as_segments() -> anyhow::Result<()> {
    let out = tmp("fused");
    let flags = [
        "--gradient-checkpointing",
        "--fused-backward",
        "--accum",
        "1",
        "--max-steps",
        "2",
        "--eval-every",
        "0",
    ];
    let mut s = setup(&args(&out, &flags)?)?;
    let segments = s.task.unet.segments();
    let seg = s.task.store.segments(&segments);
    let (trainable, _) = s.task.store.count(true);
    let summary = s.train()?;
    assert_eq!(summary.steps, 2);
    let early = ft_trainer::train::logged(&out.join("metrics.jsonl"), "updated_in_backward")?;
    assert_eq!(early, vec![serde_json::json!(seg.tensors); 2]);
    // The plan of the same run bounds the gradients by the segments.
    let plan = sdxl_ft::run::plan(&args(&out, &flags)?)?;
    let grads = plan
        .rows
        .iter()
        .find(|r| r.component.contains("gradients"))
        .ok_or_else(|| anyhow::anyhow!("no gradient row:\n{}", plan.table()))?;
    assert!(seg.largest > 0 && seg.inside < trainable as u64);
    assert_eq!(
        grads.bytes,
        s.task.dtype.size_in_bytes() as u64 * (trainable as u64 - seg.inside + seg.largest),
        "{}",
        plan.table()
    );
    assert!(grads.component.contains("--fused-backward"));
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// `--fused-backward --accum 2` on the UNet: each segment's gradients go into the step's sums
/// during the first micro-batch's backward, and into the update during the second's; the
/// weights after three steps equal those of plain accumulation under the same strategy, and the
/// early updates are reported as under `--accum 1`.
#[test]
fn fused_backward_with_accumulation_equals_plain_accumulation() -> anyhow::Result<()> {
    let out = tmp("fused-accum");
    let run = |name: &str, fused: bool| -> anyhow::Result<Vec<(String, Vec<f32>)>> {
        let dir = out.join(name);
        let mut flags = vec![
            "--checkpointing",
            "blocks",
            "--accum",
            "2",
            "--max-steps",
            "3",
            "--eval-every",
            "0",
            // Clipping is global in plain training and per tensor in a fused backward.
            "--max-grad-norm",
            "0",
        ];
        if fused {
            flags.push("--fused-backward");
        }
        let mut s = setup(&args(&dir, &flags)?)?;
        let segments = s.task.unet.segments();
        let seg = s.task.store.segments(&segments);
        let summary = s.train()?;
        assert_eq!(summary.steps, 3);
        let early = ft_trainer::train::logged(&dir.join("metrics.jsonl"), "updated_in_backward")?;
        let want = if fused {
            vec![serde_json::json!(seg.tensors); 3]
        } else {
            Vec::new()
        };
        assert_eq!(early, want, "fused {fused}");
        tensors(&dir.join("checkpoint-3/unet/diffusion_pytorch_model.safetensors"))
    };
    let plain = run("plain", false)?;
    let fused = run("fused", true)?;
    assert_eq!(plain.len(), fused.len());
    for ((name, a), (_, b)) in plain.iter().zip(&fused) {
        assert!(
            a == b,
            "`{name}` differs between fused and plain accumulation"
        );
    }
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// `--fit 24GiB`, `16GiB` and `8GiB` for seed 001's setup (the full SDXL UNet, bf16 with fp32
/// masters, AdamW, batch 1 x accumulation 16, an EMA) at 128 and 1024 px on a GPU: what each
/// budget chooses and the peak it predicts (the README's and docs/benchmarks.md's table).
#[test]
fn fit_plans_for_seed_001_at_128_and_1024_px() -> anyhow::Result<()> {
    let out = tmp("fit-plans");
    let model = full_unet_pipeline(&out)?.display().to_string();
    let out_arg = out.join("run").display().to_string();
    let mut table = String::from("| px | --fit | chosen | predicted peak on the GPU | host |\n");
    let mut fitted = Vec::new();
    for res in ["128", "1024"] {
        for budget in ["24GiB", "16GiB", "8GiB"] {
            let a: sdxl_ft::cli::Args = ft_trainer::train::parse_args_from([
                "sdxl-ft",
                "--model",
                &model,
                "--device",
                "cuda",
                "--res",
                res,
                "--accum",
                "16",
                "--ema",
                "--plan",
                "--fit",
                budget,
                "--output-dir",
                &out_arg,
            ])?;
            let row = match ft_trainer::train::fit::fit(&a, sdxl_ft::run::plan) {
                Ok(Some(f)) => {
                    let limit = a.common.fit_budget()?.unwrap_or(0);
                    assert!(f.plan.device_bytes() <= limit, "{}", f.plan.table());
                    fitted.push((res, budget));
                    f.cells()
                }
                Ok(None) => anyhow::bail!("--fit {budget} gave no choice"),
                Err(e) => format!("error: {e} | | "),
            };
            table += &format!("| {res} | {budget} | {row} |\n");
        }
    }
    eprintln!("{table}");
    // Every budget fits at 128 px (the seed's 24 GB card included), and at 1024 px too; the
    // tighter the budget, the more is turned: at 1024 px no checkpointing at 24 GiB (8-bit
    // moments on the host leave room for the whole graph), checkpointing under a budget from
    // 16 GiB, a smaller budget at 8 GiB, still without the fused backward (plain accumulation
    // in segments holds one block's gradients at a time) (the README's table).
    for res in ["128", "1024"] {
        for b in ["24GiB", "16GiB", "8GiB"] {
            assert!(fitted.contains(&(res, b)), "{table}");
        }
    }
    for (row, turned) in [
        (
            "| 1024 | 24GiB | `--optim adamw8bit --offload-optimizer` |",
            "| 19.77 GiB |",
        ),
        (
            "| 1024 | 16GiB | `--checkpointing budget:",
            "--offload-optimizer` |",
        ),
        (
            "| 1024 | 8GiB | `--checkpointing budget:1546MiB",
            "--optim adamw8bit --offload-optimizer` |",
        ),
    ] {
        let line = table.lines().find(|l| l.starts_with(row));
        assert!(line.is_some_and(|l| l.contains(turned)), "{row}\n{table}");
    }
    assert!(!out.join("run").exists(), "--plan wrote the output folder");
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// The out-of-memory retry's split: a micro-batch's two halves draw the whole's flips, caption
/// dropout, timesteps, latent samples and noise (per sample, from its position in the
/// micro-batch), so their summed losses and gradients add up to the whole's.
#[test]
fn a_split_micro_batch_computes_the_whole() -> anyhow::Result<()> {
    use ft_trainer::train::{StepCtx, Task};
    let out = tmp("split");
    let a = args(
        &out,
        &[
            "--random-flip",
            "--caption-dropout",
            "0.5",
            "--noise-offset",
            "0.1",
            "--snr-gamma",
            "5",
        ],
    )?;
    let mut s = setup(&a)?;
    let params = s.optimizer.params().to_vec();
    let whole: Vec<usize> = (0..4).collect();
    let (head, tail) = s
        .task
        .split(&whole)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .ok_or_else(|| anyhow::anyhow!("four samples did not split"))?;
    assert_eq!((head.len(), tail.len()), (2, 2));
    let mut run = |batch: &Vec<usize>, first: usize| -> anyhow::Result<(f32, Vec<f32>)> {
        let ctx = StepCtx {
            step: 3,
            micro: 1,
            dropout_seed: 11,
            first_sample: first,
            checkpointer: &s.checkpointer,
        };
        let loss = s
            .task
            .summed_loss(batch, &ctx)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let grads = s.checkpointer.gradients(&loss, &params)?;
        let mut flat = Vec::new();
        for g in grads.iter().flatten() {
            flat.extend(g.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok((loss.to_scalar::<f32>()?, flat))
    };
    let (l, g) = run(&whole, 0)?;
    let (l1, g1) = run(&head, 0)?;
    let (l2, g2) = run(&tail, 2)?;
    assert!(
        (l - (l1 + l2)).abs() < 1e-5 * l.abs().max(1.0),
        "{l} vs {l1} + {l2}"
    );
    let scale = g.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = g
        .iter()
        .zip(g1.iter().zip(&g2))
        .map(|(a, (b, c))| (a - (b + c)).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 1e-5 * scale.max(1.0),
        "gradients differ by {worst} (largest {scale})"
    );
    // The tail at its own position 0 draws other noise: the positions are what makes it exact.
    let (l2_alone, _) = run(&tail, 0)?;
    assert!((l2_alone - l2).abs() > 1e-6, "{l2_alone} vs {l2}");
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// `--plan`'s latents are `--res` over the pipeline's VAE factor: the demo's three-level VAE
/// gives 32 px images 8 x 8 latents, SDXL's four levels 4 x 4 (planned at over 8 whatever the
/// VAE, the demo's plan counted a quarter of its latent area and missed its peak by 58%).
#[test]
fn the_plan_takes_the_latent_size_from_the_vae() -> anyhow::Result<()> {
    let out = tmp("plan-vae");
    let demo = sdxl_ft::demo::write(&out.join("demo-data"), 2, 1)?;
    let model = demo.model.display().to_string();
    let plan = || -> anyhow::Result<u64> {
        let a: sdxl_ft::cli::Args = ft_trainer::train::parse_args_from([
            "sdxl-ft",
            "--model",
            &model,
            "--res",
            "32",
            "--batch-size",
            "4",
            "--plan",
            "--output-dir",
            &out.join("out").display().to_string(),
        ])?;
        let held = sdxl_ft::run::plan(&a)?
            .activations()
            .ok_or_else(|| anyhow::anyhow!("no activations planned"))?;
        Ok(held.kept)
    };
    let three_levels = plan()?;
    let path = demo.model.join("vae/config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    cfg["block_out_channels"] = serde_json::json!([8, 16, 16, 16]);
    std::fs::write(&path, cfg.to_string())?;
    let four_levels = plan()?;
    // Four times the latent pixels: 2.5 times the kept activations (the time embedding and the
    // text states' keys and values do not grow; 2.9 times before the blocks' time embedding
    // went into their first convolution's bias); at one factor for both, the two would be equal.
    assert!(
        5 * three_levels > 12 * four_levels,
        "{three_levels} bytes at 8 x 8 latents, {four_levels} at 4 x 4"
    );
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}
