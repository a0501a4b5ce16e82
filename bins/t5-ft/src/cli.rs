//! t5-ft's command line (every flag is also a key of the `--config` TOML file).

use std::path::PathBuf;

use clap::Parser;
use ft_trainer::train::{Binary, CommonArgs};
use serde::{Deserialize, Serialize};

/// Fine-tune a (FLAN-)T5 model on input/target pairs, loading its weights once in the training
/// dtype. `--model` is a folder or hub id with config.json, tokenizer.json and
/// model.safetensors (or its sharded index), e.g. google/flan-t5-xl; `--from-scratch` initialises
/// the weights from --seed instead and needs the first two only.
/// `--demo`: a tiny T5 learns to reverse digit sequences.
#[derive(Parser, Serialize, Deserialize, Debug, Clone)]
#[command(version, about)]
pub struct Args {
    /// Training data: JSONL, or CSV with a header row (by extension).
    #[arg(long)]
    pub train_file: Option<PathBuf>,
    /// Evaluation data in the same format.
    #[arg(long)]
    pub eval_file: Option<PathBuf>,
    /// Name of the input field.
    #[arg(long, default_value = "input")]
    pub input_field: String,
    /// Name of the target field.
    #[arg(long, default_value = "target")]
    pub target_field: String,
    /// Truncate inputs to this many tokens.
    #[arg(long, default_value_t = 512)]
    pub max_source_length: usize,
    /// Truncate targets to this many tokens.
    #[arg(long, default_value_t = 128)]
    pub max_target_length: usize,
    /// Initialise the weights from --seed instead of loading the model's (which it then need not
    /// have): a pretraining run. Without it, a model without model.safetensors is an error.
    #[arg(long)]
    pub from_scratch: bool,
    /// Read the training records in file order, every epoch (to reproduce a reference run that
    /// does not shuffle); --seed still seeds initialisation and dropout.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Batch records of similar length together (less padding).
    #[arg(long)]
    pub group_by_length: bool,
    /// Skip malformed records (and count them) instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// Evaluate on at most this many records (0: all).
    #[arg(long, default_value_t = 0)]
    pub eval_limit: usize,
    /// Longest greedy generation in evaluation.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    #[command(flatten)]
    #[serde(flatten)]
    pub common: CommonArgs,
}

impl Args {
    /// Rejects impossible settings with a message naming the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.common.validate()?;
        if self.max_source_length == 0 || self.max_target_length == 0 {
            anyhow::bail!("--max-source-length and --max-target-length must be at least 1");
        }
        // `--plan` reads the model's config alone.
        if !self.common.demo && !self.common.plan && self.train_file.is_none() {
            anyhow::bail!("--train-file is required (or --demo for the bundled task)");
        }
        Ok(())
    }
}

impl Binary for Args {
    const DEFAULT_MODEL: Option<&'static str> = Some("google/flan-t5-small");
    const DEMO: (&'static str, &'static str) = (
        "configs/t5_demo.toml (built in)",
        include_str!("../../../configs/t5_demo.toml"),
    );

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn common_mut(&mut self) -> &mut CommonArgs {
        &mut self.common
    }
}
