//! What the t5-ft test binaries share: scratch folders and training data at the maximum lengths.

#![allow(dead_code)]

use ft_trainer::scratch::Scratch;
use std::path::{Path, PathBuf};

/// A scratch path for `tag`, absent at first and removed when dropped.
pub fn tmp(tag: &str) -> Scratch {
    Scratch::new(&format!("t5-train-{tag}"))
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
