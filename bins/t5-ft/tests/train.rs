//! t5-ft end to end on CPU: the demo learns, resume continues the same curve, saved checkpoints
//! reload, and bad input gets one clear error.

use std::path::{Path, PathBuf};

use clap::Parser;
use ft_trainer::scratch::Scratch;
use ft_trainer::train;
use ft_trainer::train::Binary;
use t5_ft::cli::Args;
use t5_ft::run::setup;

mod common;
use common::{long_examples, tmp};

fn demo_args(out: &Path, extra: &[&str]) -> Args {
    let mut v: Vec<String> = [
        "t5-ft",
        "--demo",
        "--batch-size",
        "16",
        "--accum",
        "2",
        "--lr",
        "3e-3",
        "--weight-decay",
        "0",
        "--warmup-steps",
        "5",
        "--schedule",
        "cosine",
        "--quiet",
        "--output-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(out.display().to_string());
    // A test's own --accum replaces the default of 2.
    if extra.contains(&"--accum") {
        v.drain(4..6);
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    Args::parse_from(v)
}

fn train_run(args: &Args) -> anyhow::Result<train::RunSummary> {
    let mut s = setup(args)?;
    Ok(s.train()?)
}

#[test]
fn demo_loss_falls_and_a_hugging_face_checkpoint_is_written() -> anyhow::Result<()> {
    let out = tmp("demo");
    let s = train_run(&demo_args(
        &out,
        &[
            "--max-steps",
            "60",
            "--eval-limit",
            "16",
            "--max-new-tokens",
            "8",
        ],
    ))?;
    let first: f64 = s.losses[..5].iter().sum::<f64>() / 5.0;
    let last: f64 = s.losses[s.losses.len() - 5..].iter().sum::<f64>() / 5.0;
    assert!(last < 0.3 * first, "loss {first} -> {last}");
    let dir = s.final_dir.expect("final checkpoint");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing from {}", dir.display());
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    assert_eq!(cfg["model_type"], "t5");
    assert!(s.last_eval.iter().any(|(k, _)| k == "exact_match"));
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    assert!(metrics.lines().count() >= 60);
    assert!(out.join("memory.jsonl").is_file());

    // The saved model loads back as the model source and gives the same evaluation.
    let data = out.join("demo-data");
    let reload = tmp("demo-reload");
    let again = setup(&Args::parse_from([
        "t5-ft",
        "--model",
        &dir.display().to_string(),
        "--train-file",
        &data.join("train.jsonl").display().to_string(),
        "--eval-file",
        &data.join("eval.jsonl").display().to_string(),
        "--batch-size",
        "16",
        "--eval-limit",
        "16",
        "--max-new-tokens",
        "8",
        "--output-dir",
        &reload.display().to_string(),
    ]))?;
    let reloaded = again.task.evaluate_now()?;
    let loss = |m: &[(String, f64)]| {
        m.iter()
            .find(|(k, _)| k == "loss")
            .map(|(_, v)| *v)
            .unwrap_or(f64::NAN)
    };
    assert!(
        (loss(&reloaded) - loss(&s.last_eval)).abs() < 1e-6,
        "{reloaded:?} vs {:?}",
        s.last_eval
    );
    Ok(())
}

#[test]
fn resumed_run_continues_the_same_loss_curve() -> anyhow::Result<()> {
    let full = train_run(&demo_args(
        &tmp("full"),
        &["--max-steps", "8", "--eval-limit", "4"],
    ))?;
    let part_dir = tmp("part");
    let part = train_run(&demo_args(
        &part_dir,
        &[
            "--max-steps",
            "8",
            "--save-every",
            "3",
            "--eval-limit",
            "4",
            "--eval-every",
            "0",
        ],
    ))
    .map(|_| ())
    .err();
    assert!(part.is_none());
    let ckpt = part_dir.join("checkpoint-3");
    assert!(ckpt.join("trainer_state.json").is_file());
    let resumed = train_run(&demo_args(
        &part_dir,
        &[
            "--max-steps",
            "8",
            "--eval-limit",
            "4",
            "--resume",
            &ckpt.display().to_string(),
        ],
    ))?;
    assert_eq!(resumed.losses.len(), 5);
    for (i, (a, b)) in resumed.losses.iter().zip(&full.losses[3..]).enumerate() {
        assert!(
            (a - b).abs() <= 1e-6 * b.abs(),
            "step {}: resumed {a} vs uninterrupted {b}",
            i + 4
        );
    }
    Ok(())
}

/// `--offload-optimizer` keeps masters, moments and accumulated gradients on the host: the run
/// follows the same loss curve as with the state beside the model, and its checkpoint resumes
/// (into offloaded state) on the same curve.
#[test]
fn offloaded_optimizer_follows_the_same_curve_and_resumes() -> anyhow::Result<()> {
    let steps = ["--max-steps", "6", "--eval-limit", "4", "--eval-every", "0"];
    let near = train_run(&demo_args(&tmp("near"), &steps))?;
    let host_dir = tmp("host");
    let mut with_save = steps.to_vec();
    with_save.extend(["--save-every", "3", "--offload-optimizer"]);
    let host = train_run(&demo_args(&host_dir, &with_save))?;
    assert_eq!(host.losses, near.losses, "offloaded vs beside the model");
    let ckpt = host_dir.join("checkpoint-3").display().to_string();
    let mut resume = steps.to_vec();
    resume.extend(["--offload-optimizer", "--resume", &ckpt]);
    let resumed = train_run(&demo_args(&host_dir, &resume))?;
    assert_eq!(resumed.losses, near.losses[3..], "resumed offloaded run");
    Ok(())
}

/// Seed 002's preset parses, validates and keeps the optimizer state on the host (its 32 GB card
/// cannot hold FLAN-T5-XL's fp32 masters and moments).
#[test]
fn shipped_xl_config_parses_and_offloads_the_optimizer() -> anyhow::Result<()> {
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/flan_t5_xl.toml");
    let cfg = cfg.display().to_string();
    let a: Args = ft_trainer::train::config::parse_from(
        ["t5-ft", "--config", &cfg, "--train-file", "train.jsonl"],
        |a: &Args| a.common.config.clone(),
    )?;
    a.validate()?;
    assert_eq!(a.model(), Some("google/flan-t5-xl"));
    assert_eq!((a.common.batch_size, a.common.accum), (8, 16));
    assert!(a.common.gradient_checkpointing && a.common.offload_optimizer);
    Ok(())
}

/// `--optim adamw8bit`: the demo's curve stays near fp32 AdamW's, the checkpoint stores 8-bit
/// moments (bytes in optimizer.safetensors) and resuming from it continues the same curve.
#[test]
fn eight_bit_adamw_trains_and_resumes() -> anyhow::Result<()> {
    let steps = ["--max-steps", "6", "--eval-limit", "4", "--eval-every", "0"];
    let full = train_run(&demo_args(&tmp("fp32-moments"), &steps))?;
    let dir = tmp("8bit");
    let mut with_save = steps.to_vec();
    with_save.extend(["--save-every", "3", "--optim", "adamw8bit"]);
    let q8 = train_run(&demo_args(&dir, &with_save))?;
    for (i, (a, b)) in q8.losses.iter().zip(&full.losses).enumerate() {
        assert!(
            (a - b).abs() <= 0.05 * b,
            "step {}: 8-bit {a} vs fp32 {b}",
            i + 1
        );
    }
    let ckpt = dir.join("checkpoint-3");
    let files = ft_params::weights::SafetensorsFiles::open(&[ckpt.join("optimizer.safetensors")])?;
    let exp_avg_u8 = files
        .names()
        .filter(|n| n.starts_with("exp_avg."))
        .filter(|n| {
            files
                .meta(n)
                .is_some_and(|m| format!("{:?}", m.dtype) == "U8")
        })
        .count();
    assert!(exp_avg_u8 > 0, "no 8-bit moments in the checkpoint");
    let mut resume = steps.to_vec();
    let ck = ckpt.display().to_string();
    resume.extend(["--optim", "adamw8bit", "--resume", &ck]);
    let resumed = train_run(&demo_args(&dir, &resume))?;
    assert_eq!(resumed.losses, q8.losses[3..], "resumed 8-bit run");
    Ok(())
}

/// `--optim adafactor` (HF Trainer's settings): the demo's loss falls, the checkpoint holds the
/// factored second moments by transformers' names, and resuming continues the same curve.
#[test]
fn adafactor_trains_and_resumes() -> anyhow::Result<()> {
    let dir = tmp("adafactor");
    let ckpt = trains_and_resumes(&dir, &["--optim", "adafactor"])?;
    let files = ft_params::weights::SafetensorsFiles::open(&[ckpt.join("optimizer.safetensors")])?;
    let names: Vec<&str> = files.names().collect();
    for (prefix, present) in [
        ("exp_avg_sq_row.", true),
        ("exp_avg_sq_col.", true),
        ("exp_avg.", false),
    ] {
        assert_eq!(
            names.iter().any(|n| n.starts_with(prefix)),
            present,
            "{prefix}: {names:?}"
        );
    }
    Ok(())
}

/// Six demo steps with `extra`, checkpointed at step 3: the loss falls, and resuming from the
/// checkpoint gives the last three losses again. Returns the checkpoint folder.
fn trains_and_resumes(dir: &Path, extra: &[&str]) -> anyhow::Result<PathBuf> {
    let mut steps = vec![
        "--max-steps",
        "6",
        "--eval-limit",
        "4",
        "--eval-every",
        "0",
        "--save-every",
        "3",
    ];
    steps.extend(extra);
    let run = train_run(&demo_args(dir, &steps))?;
    let l = &run.losses;
    assert!(
        l[3..].iter().sum::<f64>() < l[..3].iter().sum::<f64>(),
        "{extra:?}: {l:?}"
    );
    let ckpt = dir.join("checkpoint-3");
    let ck = ckpt.display().to_string();
    steps.extend(["--resume", &ck]);
    let resumed = train_run(&demo_args(dir, &steps))?;
    assert_eq!(resumed.losses, run.losses[3..], "{extra:?}: resumed run");
    Ok(ckpt)
}

/// `--full-bf16 --optim adafactor` (kohya's low-memory recipe): bf16 weights without masters,
/// stochastically rounded; the demo's loss falls, the checkpoint holds no masters, and the
/// rounding streams follow the step, so resuming continues the same curve.
#[test]
fn full_bf16_trains_and_resumes() -> anyhow::Result<()> {
    let dir = tmp("full-bf16");
    // One micro-batch a step: the bf16 gradients go to the update as they are.
    let flags = ["--optim", "adafactor", "--full-bf16", "--accum", "1"];
    let ckpt = trains_and_resumes(&dir, &flags)?;
    let files = ft_params::weights::SafetensorsFiles::open(&[ckpt.join("optimizer.safetensors")])?;
    assert!(
        !files.names().any(|n| n.starts_with("master.")),
        "masters saved"
    );
    let model = ft_params::weights::SafetensorsFiles::open(&[ckpt.join("model.safetensors")])?;
    let dtypes: std::collections::BTreeSet<String> = model
        .names()
        .filter_map(|n| model.meta(n).map(|m| format!("{:?}", m.dtype)))
        .collect();
    assert!(dtypes.contains("BF16"), "{dtypes:?}");
    Ok(())
}

/// `--fused-backward` (kohya's fused backward pass): each checkpointed layer's parameters are
/// updated during the backward, as soon as their gradients are final. Without clipping the run
/// is the plain one, loss for loss and weight for weight; with clipping it is per tensor. With
/// accumulation it is plain accumulation, weight for weight.
#[test]
fn fused_backward_equals_backward_then_step() -> anyhow::Result<()> {
    let flags = [
        "--max-steps",
        "4",
        "--eval-limit",
        "4",
        "--eval-every",
        "0",
        "--accum",
        "1",
        "--gradient-checkpointing",
        "--max-grad-norm",
        "0",
    ];
    let plain_dir = tmp("plain-backward");
    let plain = train_run(&demo_args(&plain_dir, &flags))?;
    let mut fused_flags = flags.to_vec();
    fused_flags.push("--fused-backward");
    let fused_dir = tmp("fused-backward");
    let mut s = setup(&demo_args(&fused_dir, &fused_flags))?;
    // The blocks `T5::segments` lists (which the plan bounds the gradients by) are what the
    // backward updates early.
    let seg = s.task.store.segments(&s.task.model.segments());
    let fused = s.train()?;
    assert_eq!(fused.losses, plain.losses);
    let weights = |dir: &Path| -> anyhow::Result<Vec<u8>> {
        Ok(std::fs::read(
            dir.join("checkpoint-4").join("model.safetensors"),
        )?)
    };
    assert_eq!(weights(&fused_dir)?, weights(&plain_dir)?, "final weights");
    // The layers' parameters were updated during the backward (the embedding and final norm
    // after it).
    let early = ft_trainer::train::logged(&fused_dir.join("metrics.jsonl"), "updated_in_backward")?;
    assert_eq!(early, vec![serde_json::json!(seg.tensors); 4]);
    assert!(seg.tensors > 10);
    // The plan holds the gradients outside the blocks (embeddings, final norms) and of the
    // largest block.
    let plan = t5_ft::run::plan(&demo_args(&fused_dir, &fused_flags))?;
    let grads = plan
        .rows
        .iter()
        .find(|r| r.component.contains("--fused-backward"))
        .ok_or_else(|| anyhow::anyhow!("no fused gradient row:\n{}", plan.table()))?;
    assert!(seg.largest > 0 && seg.inside < plan.params);
    assert_eq!(grads.bytes, 4 * (plan.params - seg.inside + seg.largest));
    // With accumulation (blocks kept, not recomputed): each block's gradients into the sums,
    // then into the update; the weights equal plain accumulation's.
    let accum = |name: &str, fused: bool| -> anyhow::Result<Vec<u8>> {
        let dir = tmp(name);
        let mut v = vec![
            "--max-steps",
            "3",
            "--eval-limit",
            "4",
            "--eval-every",
            "0",
            "--accum",
            "3",
            "--checkpointing",
            "blocks",
            "--max-grad-norm",
            "0",
        ];
        if fused {
            v.push("--fused-backward");
        }
        let summary = train_run(&demo_args(&dir, &v))?;
        assert_eq!(summary.steps, 3);
        Ok(std::fs::read(
            dir.join("checkpoint-3").join("model.safetensors"),
        )?)
    };
    assert_eq!(
        accum("fused-accum", true)?,
        accum("plain-accum", false)?,
        "--fused-backward --accum 3"
    );
    // Refused where it cannot work.
    for (extra, word) in [
        (&["--accum", "2"][..], "--gradient-checkpointing"),
        (&["--accum", "1"][..], "--gradient-checkpointing"),
    ] {
        let mut v = vec!["--fused-backward"];
        v.extend(extra);
        let e = demo_args(&tmp("fused-refused"), &v)
            .validate()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains(word), "{extra:?}: {e}");
    }
    Ok(())
}

/// A folder holding FLAN-T5-XL's `config.json` (what `--plan` reads of `google/flan-t5-xl`).
fn flan_t5_xl_config(tag: &str) -> anyhow::Result<Scratch> {
    let dir = tmp(tag);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("config.json"),
        r#"{"d_ff": 5120, "d_kv": 64, "d_model": 2048, "num_heads": 32, "num_layers": 24,
            "num_decoder_layers": 24, "feed_forward_proj": "gated-gelu",
            "tie_word_embeddings": false, "vocab_size": 32128, "model_type": "t5"}"#,
    )?;
    Ok(dir)
}

/// `--fit 24GiB`, `16GiB` and `8GiB` for seed 002's FLAN-T5-XL at batch 8 x (512 + 128) tokens
/// (bf16 with fp32 masters, AdamW, accumulation 16) on a GPU: what each budget chooses and the
/// peak it predicts (the README's and docs/benchmarks.md's table). The batch is given, so it is
/// kept: at 7 GiB the error names it and what would fit.
#[test]
fn fit_plans_for_flan_t5_xl_at_batch_8_by_512_tokens() -> anyhow::Result<()> {
    let dir = flan_t5_xl_config("xl-fit")?;
    let model = dir.display().to_string();
    let out_arg = dir.join("out").display().to_string();
    let mut table = String::from("| --fit | chosen | predicted peak on the GPU | host |\n");
    let mut fitted = Vec::new();
    for budget in ["24GiB", "16GiB", "8GiB", "7GiB"] {
        let a: Args = train::parse_args_from([
            "t5-ft",
            "--model",
            &model,
            "--device",
            "cuda",
            "--batch-size",
            "8",
            "--accum",
            "16",
            "--max-source-length",
            "512",
            "--max-target-length",
            "128",
            "--plan",
            "--fit",
            budget,
            "--output-dir",
            &out_arg,
        ])?;
        let row = match train::fit::fit(&a, t5_ft::run::plan) {
            Ok(Some(f)) => {
                let limit = a.common.fit_budget()?.unwrap_or(0);
                assert!(f.plan.device_bytes() <= limit, "{}", f.plan.table());
                fitted.push(budget);
                f.cells()
            }
            Ok(None) => anyhow::bail!("--fit {budget} gave no choice"),
            Err(e) => format!("error: {e} | | "),
        };
        table += &format!("| {budget} | {row} |\n");
    }
    eprintln!("{table}");
    assert_eq!(fitted, ["24GiB", "16GiB", "8GiB"], "{table}");
    // At 24 GiB a budget keeps segments (`--fit` searches B; before, B was the budget less
    // `full`'s plan, overshot, and `full` was chosen).
    assert!(
        table.contains("| 24GiB | `--checkpointing budget:"),
        "{table}"
    );
    // 8 GiB (7.36 GiB planned within, after the 8% reserve) fits the given batch 8 with the
    // boundaries on the host (7.30 GiB; 7.37 GiB before the norms kept one tensor, not two or
    // three); 7 GiB does not: the error names the micro-batch that would fit, with the rest
    // turned too (no fused backward: plain accumulation in segments holds one block's gradients
    // at a time already).
    assert!(
        table.contains(
            "| 8GiB | `--checkpointing full-host --optim adamw8bit --offload-optimizer` |"
        ),
        "{table}"
    );
    let row = table
        .lines()
        .find(|l| l.starts_with("| 7GiB |"))
        .unwrap_or_default();
    assert!(
        row.contains("not with --batch-size, --accum as given")
            && row.contains("--offload-optimizer --batch-size 2 --accum 64"),
        "{table}"
    );
    assert!(!dir.join("out").exists(), "--plan wrote the output folder");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// `--plan` from FLAN-T5-XL's config.json alone (no weights, no tokenizer, no GPU opened): the
/// model states of seed 002's setup on the GPU and in host memory, with and without offload.
#[test]
fn plan_of_flan_t5_xl_from_its_config() -> anyhow::Result<()> {
    let dir = flan_t5_xl_config("xl-plan")?;
    let model = dir.display().to_string();
    let out = dir.join("out");
    let out_arg = out.display().to_string();
    let plan = |extra: &[&str]| -> anyhow::Result<ft_trainer::train::plan::StatePlan> {
        // Seed 002's accumulation (configs/flan_t5_xl.toml), fp32 gradient sums, unless given.
        let mut v = vec!["t5-ft", "--model", &model, "--device", "cuda", "--plan"];
        if !extra.contains(&"--accum") {
            v.extend(["--accum", "16"]);
        }
        v.extend(["--output-dir", &out_arg]);
        v.extend(extra);
        t5_ft::run::plan(&Args::parse_from(v))
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let near = plan(&[])?;
    assert_eq!(near.params, 2_849_757_184);
    assert!(
        (gib(near.state_device_bytes()) - 53.08).abs() < 0.01,
        "{}",
        near.table()
    );
    assert_eq!(near.host_bytes(), 0);
    let host = plan(&["--offload-optimizer"])?;
    assert!(
        (gib(host.state_device_bytes()) - 10.62).abs() < 0.01,
        "{}",
        host.table()
    );
    assert!((gib(host.host_bytes()) - 42.46).abs() < 0.01);
    // Seed 002's preset checkpoints every block: each block's gradients go to the host's fp32
    // sums as its backward ends, and the GPU holds the weights and one block's gradients.
    let seed = plan(&["--offload-optimizer", "--gradient-checkpointing"])?;
    assert!(
        (gib(seed.state_device_bytes()) - 5.67).abs() < 0.01,
        "{}",
        seed.table()
    );
    assert_eq!(seed.host_bytes(), host.host_bytes());
    assert!(!out.exists(), "--plan wrote {}", out.display());
    let q8 = plan(&["--offload-optimizer", "--optim", "adamw8bit"])?;
    assert!(
        (gib(q8.host_bytes()) - 26.62).abs() < 0.01,
        "{}",
        q8.table()
    );
    eprintln!("{}", q8.table());
    // 8-bit moments beside the model (the CUDA kernel's layout): the same bytes, all on the GPU.
    let q8_gpu = plan(&["--optim", "adamw8bit"])?;
    assert_eq!(q8_gpu.host_bytes(), 0);
    assert_eq!(
        q8_gpu.state_device_bytes(),
        q8.state_device_bytes() + q8.host_bytes(),
        "{}",
        q8_gpu.table()
    );
    assert!((gib(q8_gpu.state_device_bytes()) - 37.24).abs() < 0.01);
    // One micro-batch a step: no fp32 sums, the bf16 gradients are what AdamW reads (4 bytes a
    // parameter less; offloaded, 2 bytes of them cross to the host instead of 4).
    let one = plan(&["--accum", "1"])?;
    assert_eq!(
        near.state_device_bytes() - one.state_device_bytes(),
        4 * near.params
    );
    assert!((gib(one.state_device_bytes()) - 42.46).abs() < 0.01);
    // Adafactor: one value per row and per column of each matrix, 9.65 MiB for the model,
    // beside 21.23 GiB of AdamW moments.
    let af = plan(&["--optim", "adafactor"])?;
    let states = |p: &ft_trainer::train::plan::StatePlan, what: &str| {
        p.rows
            .iter()
            .find(|r| r.component.contains(what))
            .map_or(0, |r| r.bytes)
    };
    assert!(states(&af, "Adafactor") < 10 << 20, "{}", af.table());
    assert!((gib(states(&near, "AdamW moments")) - 21.23).abs() < 0.01);
    assert!(
        (gib(af.state_device_bytes()) - 31.86).abs() < 0.01,
        "{}",
        af.table()
    );
    // --full-bf16: no fp32 masters, 4 bytes a parameter less.
    let pure = plan(&["--full-bf16"])?;
    assert_eq!(
        near.state_device_bytes() - pure.state_device_bytes(),
        4 * near.params
    );
    let one_host = plan(&["--accum", "1", "--offload-optimizer"])?;
    assert_eq!(one_host.state_device_bytes(), host.state_device_bytes());
    assert_eq!(host.host_bytes() - one_host.host_bytes(), 2 * near.params);
    // configs/flan_t5_xl_24gb.toml: Adafactor on bf16 weights without masters, one micro-batch,
    // the fused backward: bf16 weights, 9.7 MiB of Adafactor state and the gradients alive at
    // once (embeddings, final norms, the largest block), all on the GPU.
    let preset = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/flan_t5_xl_24gb.toml");
    let preset = preset.display().to_string();
    let low: Args = ft_trainer::train::config::parse_from(
        [
            "t5-ft",
            "--config",
            &preset,
            "--model",
            &model,
            "--plan",
            "--output-dir",
            &out_arg,
        ],
        |a: &Args| a.common.config.clone(),
    )?;
    low.validate()?;
    let low = t5_ft::run::plan(&low)?;
    eprintln!("{}", low.table());
    assert_eq!(low.host_bytes(), 0);
    assert!(
        (gib(low.state_device_bytes()) - 5.68).abs() < 0.01,
        "{}",
        low.table()
    );
    // Activations of one bf16 micro-batch of 8 x (512 + 128) tokens with the config's dropout,
    // by strategy (T5's formulas, tested against real graphs in ft-models' tests/activations.rs;
    // the GPU's fused attention keeps no scores).
    let mut table = String::from("| strategy | kept | + recompute | host |\n");
    let mut kept_by = Vec::new();
    for strategy in ["none", "blocks", "every:2", "full", "full-host"] {
        let p = plan(&[
            "--full-bf16",
            "--batch-size",
            "8",
            "--max-source-length",
            "512",
            "--max-target-length",
            "128",
            "--checkpointing",
            strategy,
        ])?;
        let held = p
            .activations()
            .ok_or_else(|| anyhow::anyhow!("no activations in the plan"))?;
        table += &format!("| {strategy} | {} |\n", held.cells());
        kept_by.push(held.kept);
    }
    eprintln!("{table}");
    let [none, blocks, every2, full, full_host] = kept_by[..] else {
        anyhow::bail!("five strategies")
    };
    assert!(full_host < full && full < every2 && every2 < none && none < blocks);
    // The README's figures.
    assert!((gib(none) - 20.97).abs() < 0.01, "{table}");
    assert!((gib(full) * 1024.0 - 961.0).abs() < 0.01, "{table}");
    Ok(())
}

/// The plan's activations are those of the training data's longest source and target after
/// truncation (a batch pads to its longest): the demo's short examples plan far less than
/// examples at the maximum lengths, which plan exactly 512 + 128 tokens.
#[test]
fn the_plan_takes_the_training_datas_longest_examples() -> anyhow::Result<()> {
    let out = tmp("plan-lengths");
    let long = long_examples(&out.join("data"))?;
    let short = t5_ft::run::plan(&demo_args(&out, &[]))?;
    let long_path = long.display().to_string();
    let at_max = t5_ft::run::plan(&demo_args(&out, &["--train-file", &long_path]))?;
    let row = |p: &ft_trainer::train::plan::StatePlan| -> String {
        let r = p.rows.iter().find(|r| r.activation);
        r.map(|r| r.component.clone()).unwrap_or_default()
    };
    assert!(
        row(&at_max).contains("batch 16 x 512 + 128 tokens, the training data's longest"),
        "{}",
        row(&at_max)
    );
    assert!(
        row(&short).contains("the training data's longest"),
        "{}",
        row(&short)
    );
    assert!(!row(&short).contains("512 + 128"), "{}", row(&short));
    assert!(
        10 * short.activation_device_bytes() < at_max.activation_device_bytes(),
        "{} against {}",
        short.activation_device_bytes(),
        at_max.activation_device_bytes()
    );
    Ok(())
}

/// `--fit SIZE`: the cheapest settings whose plan fits, keeping the effective batch and every
/// setting the user gave (flags and `--config` keys); one clear error when nothing fits.
#[test]
fn fit_chooses_the_cheapest_settings_that_fit_and_keeps_given_ones() -> anyhow::Result<()> {
    let out = tmp("fit");
    // The demo's model on examples as long as its maximum lengths: the plan counts the data's
    // longest.
    let long = long_examples(&out)?;
    let parse = |extra: &[&str]| -> anyhow::Result<Args> {
        let mut v = vec!["t5-ft", "--demo", "--plan", "--output-dir"];
        let dir = out.display().to_string();
        v.push(&dir);
        let long = long.display().to_string();
        v.extend_from_slice(&["--train-file", &long]);
        v.extend_from_slice(extra);
        Ok(train::parse_args_from::<Args, _, _>(v)?)
    };
    let fitted = |a: &Args| -> anyhow::Result<train::fit::Fitted<Args>> {
        train::fit::fit(a, t5_ft::run::plan)?.ok_or_else(|| anyhow::anyhow!("no --fit"))
    };
    // The error's message, or "" when it fitted.
    let refusal = |r: &anyhow::Result<train::fit::Fitted<Args>>| match r {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    };
    let mib = 1u64 << 20;
    // Room to spare beyond the reserve (8% of the budget): nothing changes.
    let base = parse(&[])?;
    let whole = t5_ft::run::plan(&base)?.device_bytes();
    let f = fitted(&parse(&["--fit", &format!("{}", whole * 100 / 92 + mib)])?)?;
    assert!(f.chosen.is_empty(), "{:?}", f.chosen);
    assert_eq!(f.args.common.checkpointing, base.common.checkpointing);
    // A MiB to spare but not the reserve: a choice is made within 92% of the budget; with
    // `--fit-reserve 0` the run fits as it is, to the budget's last MiB.
    let tight = format!("{}", whole + mib);
    let f = fitted(&parse(&["--fit", &tight])?)?;
    assert!(!f.chosen.is_empty(), "{}", f.report());
    assert!(f.plan.device_bytes() <= (whole + mib) * 92 / 100 + 1);
    assert!(f.report().contains("held in reserve"), "{}", f.report());
    let f = fitted(&parse(&["--fit", &tight, "--fit-reserve", "0"])?)?;
    assert!(f.chosen.is_empty(), "{}", f.report());
    let f = fitted(&parse(&["--fit", &tight, "--fit-reserve", "2MiB"])?)?;
    assert!(!f.chosen.is_empty(), "{}", f.report());
    for (reserve, why) in [
        ("300MiB", "holds back the whole --fit budget"),
        ("100%", "a share from 0% to under 100%"),
        ("lots", "`lots` is not a size"),
        ("10", "a size with its unit"),
    ] {
        let e = refusal(&fitted(&parse(&[
            "--fit",
            "300MiB",
            "--fit-reserve",
            reserve,
        ])?));
        assert!(
            e.contains("--fit-reserve") && e.contains(why),
            "{reserve}: {e}"
        );
    }
    for none in ["0", "0MiB", "0%"] {
        let f = fitted(&parse(&["--fit", &tight, "--fit-reserve", none])?)?;
        assert!(f.chosen.is_empty(), "{none}: {}", f.report());
    }
    let e = refusal(&fitted(&parse(&["--fit-reserve", "8%"])?));
    assert!(e.contains("without --fit"), "{e}");
    // Tighter: the checkpointing first, then smaller micro-batches with the same effective
    // batch; every choice's plan within the budget.
    let effective = base.common.batch_size * base.common.accum;
    for budget in [320 * mib, 84 * mib] {
        let f = fitted(&parse(&["--fit", &budget.to_string()])?)?;
        assert!(f.plan.device_bytes() <= f.target, "{}", f.report());
        assert!(f.target <= budget * 92 / 100, "{}", f.report());
        assert_eq!(f.plan, t5_ft::run::plan(&f.args)?);
        assert!(f.args.common.checkpointing.is_some(), "{}", f.report());
        assert_eq!(f.args.common.batch_size * f.args.common.accum, effective);
        assert!(
            f.report().contains("chose --checkpointing"),
            "{}",
            f.report()
        );
        // A budget chosen keeps segments, and its B is the least that keeps them: a MiB
        // less keeps less (B is not left just short of keeping one more).
        let strategy = f.args.common.checkpointing.clone().unwrap_or_default();
        if let Some(b) = strategy
            .strip_prefix("budget:")
            .and_then(|b| b.strip_suffix("MiB"))
        {
            let kept = |s: String| -> anyhow::Result<u64> {
                let mut a = f.args.clone();
                a.common.checkpointing = Some(s);
                let held = t5_ft::run::plan(&a)?.activations();
                Ok(held.map_or(0, |h| h.kept))
            };
            let b: u64 = b.parse()?;
            let at = kept(strategy.clone())?;
            assert!(at > kept("full".into())?, "{}", f.report());
            assert!(kept(format!("budget:{}MiB", b - 1))? < at, "{}", f.report());
        }
    }
    // At 1 GiB no checkpointing fits batch 16, so the search turns every knob up to the
    // micro-batch; half the batch fits without the fused backward, and without it the
    // checkpointing walks back to `none` (a first pass, with the fused backward still on, stopped
    // at a budget: `none` refuses the fused backward).
    let halved = fitted(&parse(&["--fit", "1GiB"])?)?;
    assert_eq!(
        halved.chosen,
        [format!(
            "--batch-size {} --accum {}",
            base.common.batch_size / 2,
            base.common.accum * 2
        )],
        "{}",
        halved.report()
    );
    // Cheapest first: where the checkpointing suffices, nothing else changes.
    let roomy = fitted(&parse(&["--fit", "1300MiB"])?)?;
    assert_eq!(roomy.chosen.len(), 1, "{}", roomy.report());
    assert_eq!(roomy.args.common.batch_size, base.common.batch_size);
    assert_eq!(roomy.args.common.optim, base.common.optim);
    // Once the micro-batch had to shrink, the checkpointing is walked back from full-host to
    // the cheapest strategy that still fits (a budget).
    let small = fitted(&parse(&["--fit", "84MiB"])?)?;
    assert!(small.args.common.batch_size < base.common.batch_size);
    let strategy = small.args.common.checkpointing.clone().unwrap_or_default();
    assert!(strategy.starts_with("budget:"), "{}", small.report());
    // Arguments that make no run get their own error, not a search.
    let e = refusal(&fitted(&parse(&["--fit", "84MiB", "--lr=0"])?));
    assert!(e.contains("--lr"), "{e}");
    // A flag given is kept: the error names it and what would fit without it.
    let e = refusal(&fitted(&parse(&["--fit", "84MiB", "--batch-size", "16"])?));
    assert!(
        e.contains("--batch-size") && e.contains("as given") && e.contains("it fits with"),
        "{e}"
    );
    // So is a key of the --config file.
    let cfg = out.with_extension("toml");
    std::fs::write(&cfg, "checkpointing = \"none\"\n")?;
    let e = refusal(&fitted(&parse(&[
        "--fit",
        "84MiB",
        "--config",
        &cfg.display().to_string(),
    ])?));
    assert!(
        e.contains("--checkpointing") && e.contains("as given"),
        "{e}"
    );
    // Nothing fits: the smallest plan is named.
    let e = refusal(&fitted(&parse(&["--fit", "1MiB"])?));
    assert!(
        e.contains("no setting fits") && e.contains("smallest plan needs"),
        "{e}"
    );
    let e = refusal(&fitted(&parse(&["--fit", "lots"])?));
    assert!(
        e.contains("--fit") && e.contains("`lots` is not a size"),
        "{e}"
    );
    std::fs::remove_file(&cfg).ok();
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}
