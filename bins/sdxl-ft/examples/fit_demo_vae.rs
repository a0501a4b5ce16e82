//! `cargo run -p sdxl-ft --release --example fit_demo_vae [STEPS] [OUT]`: fits the demo's VAE
//! to the demo's kind of images (see `sdxl_ft::demo::vae_fit`) and writes it as a diffusers
//! `vae/` folder, by default `bins/sdxl-ft/assets/demo-vae/`, the folder `sdxl-ft --demo` embeds.

use std::path::PathBuf;
use std::time::Instant;

use sdxl_ft::demo::vae_fit;

const BATCH: usize = 16;
const LR: f64 = 2e-3;
const SEED: u64 = 0;

fn main() -> anyhow::Result<()> {
    let mut argv = std::env::args().skip(1);
    let steps: usize = argv.next().map_or(Ok(1500), |s| s.parse())?;
    let out = argv.next().map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/demo-vae"),
        PathBuf::from,
    );
    let t0 = Instant::now();
    let fitted = vae_fit::fit(steps, BATCH, LR, SEED, |step, mse| {
        if step % 100 == 0 || step + 1 == steps {
            eprintln!(
                "step {step:>5}  mse {mse:.5}  ({:.0} s)",
                t0.elapsed().as_secs_f64()
            );
        }
    })?;
    vae_fit::write(&fitted, &out)?;
    let preview = std::env::temp_dir().join("demo-vae-preview.png");
    let psnr = vae_fit::preview(&out, 8, &preview)?;
    println!(
        "reconstruction of 8 fresh scenes: PSNR {psnr:.1} dB (originals above, reconstructions below: {})",
        preview.display()
    );
    let r = fitted.report;
    println!(
        "fitted {} steps of {BATCH} scenes in {:.0} s: pixel MSE {:.4} -> {:.5}, scaling_factor {:.5}; written to {}",
        r.steps,
        t0.elapsed().as_secs_f64(),
        r.first_mse,
        r.last_mse,
        r.scaling_factor,
        out.display()
    );
    Ok(())
}
