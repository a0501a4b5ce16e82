//! What the t5-ft test binaries share: scratch folders and training data at the maximum lengths.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A fresh scratch folder for `tag` (removed if a previous run left it).
pub fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("t5-train-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// 40 examples of 600 + 200 digits in `dir/long.jsonl`: 512 + 128 tokens after the demo
/// tokenizer's truncation, the most a batch can hold.
pub fn long_examples(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let long = dir.join("long.jsonl");
    let digits = |n: usize| {
        (0..n)
            .map(|i| (i % 10).to_string())
            .collect::<Vec<_>>()
            .join(" ")
    };
    let line = serde_json::json!({"input": digits(600), "target": digits(200)}).to_string();
    std::fs::write(&long, format!("{line}\n").repeat(40))?;
    Ok(long)
}
