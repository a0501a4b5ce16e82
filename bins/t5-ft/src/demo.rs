//! The bundled default: a tiny T5 config, a word-level tokenizer and a synthetic task (reverse a
//! sequence of digits), written into the run's folder so the demo runs anywhere.

use std::path::Path;

use ft_params::rng::SplitMix64;

const CONFIG: &str = include_str!("../../../configs/demo/t5/config.json");
const TOKENIZER: &str = include_str!("../../../configs/demo/t5/tokenizer.json");

fn example(rng: &mut SplitMix64) -> String {
    let n = 3 + rng.below(4);
    let digits: Vec<String> = (0..n).map(|_| rng.below(10).to_string()).collect();
    let rev: Vec<String> = digits.iter().rev().cloned().collect();
    serde_json::json!({"input": format!("reverse: {}", digits.join(" ")), "target": rev.join(" ")})
        .to_string()
}

/// Writes `model/{config.json,tokenizer.json}`, `train.jsonl` (`n_train` lines) and `eval.jsonl`.
pub fn write(dir: &Path, n_train: usize, n_eval: usize, seed: u64) -> anyhow::Result<()> {
    let model = dir.join("model");
    std::fs::create_dir_all(&model)?;
    std::fs::write(model.join("config.json"), CONFIG)?;
    std::fs::write(model.join("tokenizer.json"), TOKENIZER)?;
    let mut rng = SplitMix64::new(seed);
    let lines =
        |n: usize, rng: &mut SplitMix64| (0..n).map(|_| example(rng) + "\n").collect::<String>();
    std::fs::write(dir.join("train.jsonl"), lines(n_train, &mut rng))?;
    std::fs::write(dir.join("eval.jsonl"), lines(n_eval, &mut rng))?;
    Ok(())
}
