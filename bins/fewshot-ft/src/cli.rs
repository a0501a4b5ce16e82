//! fewshot-ft's command line (every flag is also a key of the `--config` TOML file).

use std::path::PathBuf;

use clap::Parser;
use ft_trainer::train::{Binary, CommonArgs};
use serde::{Deserialize, Serialize};

/// Train and evaluate FSCT (cosine or softmax attention) or ProtoNet on N-way K-shot episodes.
///
/// `--model` is a folder written by an earlier run (model.safetensors, e.g. its best/) to start
/// from; without it the weights are initialised from --seed. `--demo` trains Conv4 FSCT_cosine
/// on generated images (no dataset needed).
#[derive(Parser, Serialize, Deserialize, Debug, Clone)]
#[command(version, about)]
pub struct Args {
    /// Dataset folder: miniImageNet (train.csv, val.csv, test.csv, images/), train/ val/ test/
    /// folders of class folders, or one folder of class folders (split 64/16/20 by seed).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Backbone: conv4, conv6, resnet10, resnet18, resnet34.
    #[arg(long, default_value = "conv4")]
    pub backbone: String,
    /// Method: fsct_cosine, fsct_softmax, protonet.
    #[arg(long, default_value = "fsct_cosine")]
    pub method: String,
    /// Classes per episode.
    #[arg(long, default_value_t = 5)]
    pub n_way: usize,
    /// Support images per class.
    #[arg(long, default_value_t = 1)]
    pub k_shot: usize,
    /// Query images per class (lower it to save memory; see docs/benchmarks.md).
    #[arg(long, default_value_t = 16)]
    pub n_query: usize,
    /// Training episodes per epoch.
    #[arg(long, default_value_t = 200)]
    pub n_episode: usize,
    /// Validation episodes after each epoch (0: no validation; the last checkpoint is tested).
    #[arg(long, default_value_t = 600)]
    pub val_episodes: usize,
    /// Test episodes at the end (mean accuracy with its 95% confidence interval).
    #[arg(long, default_value_t = 600)]
    pub test_episodes: usize,
    /// Image side in pixels (default: 84 for Conv backbones, 224 for ResNets).
    #[arg(long)]
    pub image_size: Option<usize>,
    /// Global-average-pool the backbone's features instead of flattening them (the paper flattens).
    #[arg(long)]
    pub pooled: bool,
    /// Random crop and flip of training images.
    #[arg(long)]
    pub augment: bool,
    /// Stop after this many validations without a better accuracy (0: never).
    #[arg(long, default_value_t = 0)]
    pub patience: usize,
    #[command(flatten)]
    #[serde(flatten)]
    pub common: CommonArgs,
}

impl Args {
    /// Rejects impossible settings with a message naming the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.common.validate()?;
        if self.n_way < 2 || self.k_shot == 0 || self.n_query == 0 || self.n_episode == 0 {
            anyhow::bail!(
                "an episode needs --n-way >= 2 and --k-shot, --n-query, --n-episode >= 1"
            );
        }
        if self.test_episodes == 0 {
            anyhow::bail!("--test-episodes must be at least 1");
        }
        // `--plan` needs the model's settings alone.
        if !self.common.demo && !self.common.plan && self.data_dir.is_none() {
            anyhow::bail!("--data-dir is required (or --demo for generated images)");
        }
        Ok(())
    }
}

impl Binary for Args {
    const DEMO: (&'static str, &'static str) = (
        "configs/fewshot_demo.toml (built in)",
        include_str!("../../../configs/fewshot_demo.toml"),
    );
    /// The paper's optimiser settings: the defaults unless a config file or flag says otherwise.
    const DEFAULTS: Option<(&'static str, &'static str)> = Some((
        "configs/fewshot_defaults.toml (built in)",
        include_str!("../../../configs/fewshot_defaults.toml"),
    ));

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn common_mut(&mut self) -> &mut CommonArgs {
        &mut self.common
    }
}
