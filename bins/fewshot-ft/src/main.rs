//! `fewshot-ft`: episodic few-shot training with the Few-Shot Cosine Transformer (the job itself
//! lands with its own issue; this binary already resolves its command line and config file).

use std::path::PathBuf;

use clap::Parser;
use ft_memory::config::CommonArgs;
use serde::{Deserialize, Serialize};

/// Train and evaluate FSCT (cosine or softmax attention) or ProtoNet on N-way K-shot episodes.
#[derive(Parser, Serialize, Deserialize, Debug)]
#[command(version, about)]
struct Args {
    /// TOML file with any of these settings; flags given here override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Dataset: a folder of class sub-folders, or miniImageNet's folder with split CSVs.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Backbone: conv4, conv6, resnet10, resnet18, resnet34.
    #[arg(long, default_value = "conv4")]
    backbone: String,
    /// Method: fsct_cosine, fsct_softmax, protonet.
    #[arg(long, default_value = "fsct_cosine")]
    method: String,
    /// Classes per episode.
    #[arg(long, default_value_t = 5)]
    n_way: usize,
    /// Support images per class.
    #[arg(long, default_value_t = 1)]
    k_shot: usize,
    /// Query images per class.
    #[arg(long, default_value_t = 16)]
    n_query: usize,
    /// Episodes per epoch.
    #[arg(long, default_value_t = 200)]
    n_episode: usize,
    /// Train on synthetic images generated on the fly.
    #[arg(long)]
    demo: bool,
    #[command(flatten)]
    #[serde(flatten)]
    common: CommonArgs,
}

fn main() -> anyhow::Result<()> {
    let args: Args = ft_memory::config::parse(|a: &Args| a.config.clone())?;
    args.common.validate()?;
    if args.n_way < 2 || args.k_shot == 0 || args.n_query == 0 || args.n_episode == 0 {
        anyhow::bail!("an episode needs --n-way >= 2 and --k-shot, --n-query, --n-episode >= 1");
    }
    println!("{}", toml::to_string(&args)?);
    anyhow::bail!(
        "fewshot-ft: configuration is valid; the training job is not built yet (issue #5)"
    )
}
