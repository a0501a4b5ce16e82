//! `sdxl-ft`: SDXL UNet full fine-tune (the job itself lands with its own issue; this binary
//! already resolves its command line and config file the way the finished tool will).

use std::path::PathBuf;

use clap::Parser;
use ft_memory::config::CommonArgs;
use serde::{Deserialize, Serialize};

/// Full fine-tune of the SDXL UNet with cached conditioning, EMA off the device and chunked VAE decode.
#[derive(Parser, Serialize, Deserialize, Debug)]
#[command(version, about)]
struct Args {
    /// TOML file with any of these settings; flags given here override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// diffusers folder or hub id.
    #[arg(long, default_value = "stabilityai/stable-diffusion-xl-base-1.0")]
    model: String,
    /// Images with captions (metadata.jsonl or sidecar .txt files).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Training resolution in pixels (square).
    #[arg(long, default_value_t = 1024)]
    res: usize,
    /// Keep an EMA of the UNet.
    #[arg(long)]
    ema: bool,
    /// Where the EMA lives: cpu (default) or the training device.
    #[arg(long, default_value = "cpu")]
    ema_device: String,
    /// Latents decoded per VAE call when writing samples.
    #[arg(long, default_value_t = 1)]
    vae_decode_chunk: usize,
    /// Train the bundled tiny UNet on the bundled synthetic images.
    #[arg(long)]
    demo: bool,
    #[command(flatten)]
    #[serde(flatten)]
    common: CommonArgs,
}

fn main() -> anyhow::Result<()> {
    let args: Args = ft_memory::config::parse(|a: &Args| a.config.clone())?;
    args.common.validate()?;
    if args.res == 0 || !args.res.is_multiple_of(8) {
        anyhow::bail!(
            "--res {} must be a positive multiple of 8 (the VAE downsamples by 8)",
            args.res
        );
    }
    if args.vae_decode_chunk == 0 {
        anyhow::bail!("--vae-decode-chunk must be at least 1");
    }
    println!("{}", toml::to_string(&args)?);
    anyhow::bail!("sdxl-ft: configuration is valid; the training job is not built yet (issue #4)")
}
