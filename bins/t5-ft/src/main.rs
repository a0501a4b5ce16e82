//! `t5-ft`: FLAN-T5 seq2seq full fine-tune (the job itself lands with its own issue; this binary
//! already resolves its command line and config file the way the finished tool will).

use std::path::PathBuf;

use clap::Parser;
use ft_memory::config::CommonArgs;
use serde::{Deserialize, Serialize};

/// Fine-tune a (FLAN-)T5 model on input/target pairs, loading its weights once in the training dtype.
#[derive(Parser, Serialize, Deserialize, Debug)]
#[command(version, about)]
struct Args {
    /// TOML file with any of these settings; flags given here override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Model folder or hub id (e.g. google/flan-t5-xl).
    #[arg(long, default_value = "google/flan-t5-small")]
    model: String,
    /// Training data: JSONL or CSV with input and target fields.
    #[arg(long)]
    train_file: Option<PathBuf>,
    /// Evaluation data in the same format.
    #[arg(long)]
    eval_file: Option<PathBuf>,
    /// Name of the input field.
    #[arg(long, default_value = "input")]
    input_field: String,
    /// Name of the target field.
    #[arg(long, default_value = "target")]
    target_field: String,
    /// Truncate inputs to this many tokens.
    #[arg(long, default_value_t = 512)]
    max_source_length: usize,
    /// Truncate targets to this many tokens.
    #[arg(long, default_value_t = 128)]
    max_target_length: usize,
    /// Train the bundled tiny model on the bundled synthetic task.
    #[arg(long)]
    demo: bool,
    #[command(flatten)]
    #[serde(flatten)]
    common: CommonArgs,
}

fn main() -> anyhow::Result<()> {
    let args: Args = ft_memory::config::parse(|a: &Args| a.config.clone())?;
    args.common.validate()?;
    if args.max_source_length == 0 || args.max_target_length == 0 {
        anyhow::bail!("--max-source-length and --max-target-length must be at least 1");
    }
    println!("{}", toml::to_string(&args)?);
    anyhow::bail!("t5-ft: configuration is valid; the training job is not built yet (issue #3)")
}
