//! Shared helpers of sdxl-ft's tests: fresh folders, demo arguments, reading saved weights.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use clap::Parser;
use ft_params::weights::SafetensorsFiles;
use sdxl_ft::cli::Args;
pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sdxl-ft-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

pub fn args(out: &Path, extra: &[&str]) -> anyhow::Result<Args> {
    let out = out.display().to_string();
    let mut v = vec![
        "sdxl-ft",
        "--demo",
        "--quiet",
        "--output-dir",
        &out,
        "--res",
        "32",
        "--batch-size",
        "4",
        "--lr",
        "1e-3",
        "--weight-decay",
        "0",
        "--sample-steps",
        "4",
        "--num-samples",
        "2",
        "--eval-images",
        "8",
    ];
    v.extend_from_slice(extra);
    Ok(Args::try_parse_from(v)?)
}

pub fn tensors(path: &Path) -> anyhow::Result<Vec<(String, Vec<f32>)>> {
    let files = SafetensorsFiles::open(&[path.to_path_buf()])?;
    let mut names: Vec<String> = files.names().map(str::to_string).collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let t = files.load(
                &n,
                None,
                candle_core::DType::F32,
                &candle_core::Device::Cpu,
                false,
            )?;
            Ok((n, t.flatten_all()?.to_vec1()?))
        })
        .collect()
}
