//! `--model owner/name` on a diffusers repository in the hf-hub cache, offline: the pipeline opens
//! from the snapshot (configs, both tokenizers' vocab.json + merges.txt, weights in subfolders)
//! and a short run trains from it. Its own test binary, because it sets process env vars.

mod common;

use common::{args, tmp};
use sdxl_ft::pipeline::Pipeline;

fn copy_dir(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()))?;
        } else {
            std::fs::copy(e.path(), to.join(e.file_name()))?;
        }
    }
    Ok(())
}

#[test]
fn hub_id_opens_a_cached_diffusers_snapshot_offline() -> anyhow::Result<()> {
    let out = tmp("hub");
    let home = out.join("hf-home");
    let commit = "89abcdef0123456789abcdef0123456789abcdef";
    let repo_dir = home.join("hub").join("models--tiny-org--tiny-sdxl");
    let snap = repo_dir.join("snapshots").join(commit);
    sdxl_ft::demo::write_model(&out.join("model"), 5)?;
    copy_dir(&out.join("model"), &snap)?;
    std::fs::create_dir_all(repo_dir.join("refs"))?;
    std::fs::write(repo_dir.join("refs").join("main"), commit)?;
    std::env::set_var("HF_HOME", &home);
    std::env::set_var("HF_HUB_OFFLINE", "1");

    let p = Pipeline::open("tiny-org/tiny-sdxl", None)?;
    assert!(p.force_zeros_for_empty_prompt);
    let tok = p.tokenizer(2)?;
    assert_eq!(tok.encode("a red circle")?.len(), 77);
    assert!(p.weights("unet", "diffusion_pytorch_model")?.paths()[0].starts_with(&home));
    // A variant the snapshot lacks falls back to the default weights.
    let pv = Pipeline::open("tiny-org/tiny-sdxl", Some("fp16".into()))?;
    let w = pv.weights("vae", "diffusion_pytorch_model");
    assert!(w.is_ok(), "{:?}", w.err());

    let images = out.join("images");
    sdxl_ft::demo::write_images(&images, 8, 2)?;
    let data = images.display().to_string();
    let mut a = args(&out.join("run"), &["--data-dir", &data, "--max-steps", "2"])?;
    a.common.demo = false;
    a.common.model = Some("tiny-org/tiny-sdxl".into());
    let mut s = sdxl_ft::run::setup(&a)?;
    let summary = s.train()?;
    assert_eq!(summary.steps, 2);
    let e = Pipeline::open("tiny-org/not-cached", None)
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(
        e.contains("model_index.json") && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
    std::fs::remove_dir_all(&out)?;
    Ok(())
}
