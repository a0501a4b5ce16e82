//! `--config FILE` then explicit flags: precedence, unknown keys and wrong types name the file.

use std::path::PathBuf;

use clap::Parser;
use ft_trainer::scratch::Scratch;
use serde::{Deserialize, Serialize};

#[derive(Parser, Serialize, Deserialize, Debug, PartialEq)]
struct Args {
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    #[arg(long, default_value_t = 1)]
    accum: usize,
    #[arg(long, default_value = "bf16")]
    precision: String,
    #[arg(long)]
    demo: bool,
}

fn parse(args: &[&str]) -> ft_trainer::Result<Args> {
    ft_trainer::train::config::parse_from(args.iter().copied(), |a: &Args| a.config.clone())
}

fn write(name: &str, text: &str) -> Scratch {
    let p = Scratch::new(&format!("ftcfg-{name}"));
    std::fs::write(&p, text).expect("write config");
    p
}

#[test]
fn file_overrides_defaults_and_flags_override_file() -> anyhow::Result<()> {
    let f = write("ok.toml", "lr = 0.5\naccum = 16\ndemo = true\n");
    let a = parse(&[
        "x",
        "--config",
        f.to_str().unwrap_or_default(),
        "--accum",
        "4",
    ])?;
    assert_eq!(a.lr, 0.5, "from the file");
    assert_eq!(a.accum, 4, "the flag wins");
    assert!(a.demo);
    assert_eq!(a.precision, "bf16", "default kept");
    let plain = parse(&["x", "--lr", "0.25"])?;
    assert_eq!((plain.lr, plain.accum), (0.25, 1));
    Ok(())
}

#[test]
fn unknown_key_and_wrong_type_name_the_file() {
    let f = write("unknown.toml", "learning_rate = 0.5\n");
    let e = parse(&["x", "--config", f.to_str().unwrap_or_default()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown.toml") && e.contains("learning_rate") && e.contains("lr"),
        "{e}"
    );
    let f = write("type.toml", "accum = \"many\"\n");
    let e = parse(&["x", "--config", f.to_str().unwrap_or_default()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("type.toml"), "{e}");
    let e = parse(&["x", "--config", "/nonexistent/cfg.toml"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/cfg.toml"), "{e}");
}

#[test]
fn preset_sits_between_defaults_and_the_file() -> anyhow::Result<()> {
    let preset = |_: &Args| Some(("preset", "lr = 0.001\naccum = 8\n"));
    let p = |args: &[&str]| {
        ft_trainer::train::config::parse_with_preset(
            args.iter().copied(),
            |a: &Args| a.config.clone(),
            preset,
        )
    };
    let a = p(&["x"])?;
    assert_eq!((a.lr, a.accum), (0.001, 8));
    let f = write("over-preset.toml", "accum = 2\n");
    let a = p(&[
        "x",
        "--config",
        f.to_str().unwrap_or_default(),
        "--lr",
        "0.5",
    ])?;
    assert_eq!(
        (a.lr, a.accum),
        (0.5, 2),
        "file beats preset, flag beats both"
    );
    Ok(())
}

/// `--device` is checked when the flags are (a misspelling would otherwise plan, or validate,
/// as a GPU run and fail only when the device is opened).
#[test]
fn device_names_are_checked_with_the_flags() {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        common: ft_trainer::train::CommonArgs,
    }
    for (device, ok) in [
        ("cpu", true),
        ("cuda", true),
        ("cuda:1", true),
        ("cdua", false),
        ("cuda:x", false),
    ] {
        let r = Cli::parse_from(["t", "--device", device]).common.validate();
        assert_eq!(r.is_ok(), ok, "{device}: {r:?}");
        if let Err(e) = r {
            assert!(e.to_string().contains(device), "{e}");
        }
    }
}

/// `--optim adamw8bit` on a GPU: the moments stay on the GPU where the CUDA kernels are built
/// (and on); a build without them needs `--offload-optimizer`, and says so.
#[test]
fn eight_bit_adamw_on_a_gpu_needs_the_kernels_or_offload() {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        common: ft_trainer::train::CommonArgs,
    }
    let check = |extra: &[&str]| {
        let mut args = vec!["t", "--device", "cuda", "--optim", "adamw8bit"];
        args.extend(extra);
        Cli::parse_from(args).common.validate()
    };
    assert!(check(&["--offload-optimizer"]).is_ok());
    let on_gpu = check(&[]);
    let kernels_off = std::env::var("FT_CUDA_KERNELS")
        .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "0" | "off" | "false"));
    if cfg!(feature = "cuda") && !kernels_off {
        assert!(on_gpu.is_ok(), "{on_gpu:?}");
    } else {
        let e = on_gpu.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("--offload-optimizer"), "{e}");
    }
}

/// `--zero` and `--plan-ranks` are checked with the flags: a stage ZeRO has (with or without the
/// fused backward); `--plan-ranks` only with `--plan`, and at least one rank.
#[test]
fn zero_and_plan_ranks_are_checked_with_the_flags() {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        common: ft_trainer::train::CommonArgs,
    }
    let check = |extra: &[&str]| {
        let mut args = vec!["t"];
        args.extend(extra);
        Cli::parse_from(args)
            .common
            .validate()
            .err()
            .map(|e| e.to_string())
    };
    for ok in [
        &["--zero", "1"][..],
        &["--zero", "2", "--plan", "--plan-ranks", "5"],
        &[
            "--zero",
            "2",
            "--fused-backward",
            "--checkpointing",
            "blocks",
        ],
    ] {
        assert_eq!(check(ok), None, "{ok:?}");
    }
    for (bad, says) in [
        (&["--zero", "3"][..], "--zero must be"),
        (&["--plan-ranks", "5"], "goes with --plan"),
        (&["--plan", "--plan-ranks", "0"], "at least 1"),
    ] {
        let e = check(bad).unwrap_or_default();
        assert!(e.contains(says), "{bad:?}: {e}");
    }
}

/// `--full-bf16` gives bf16 weights without masters on any device, and refuses the flags it
/// contradicts by name.
#[test]
fn full_bf16_is_checked_with_the_flags() {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        common: ft_trainer::train::CommonArgs,
    }
    let parse = |extra: &[&str]| {
        let mut args = vec!["t", "--full-bf16"];
        args.extend(extra);
        Cli::parse_from(args).common
    };
    let c = parse(&[]);
    assert!(c.validate().is_ok());
    let p = c.planned_precision().expect("precision");
    assert_eq!(p.storage, candle_core::DType::BF16);
    assert!(!p.master_weights && p.stochastic_rounding);
    for (extra, word) in [
        (&["--precision", "f16"][..], "--precision"),
        (&["--offload-optimizer"][..], "--offload-optimizer"),
    ] {
        let e = parse(extra)
            .validate()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains(word) && e.contains("--full-bf16"),
            "{extra:?}: {e}"
        );
    }
    assert!(parse(&["--precision", "bf16", "--optim", "adafactor"])
        .validate()
        .is_ok());
    // 8-bit AdamW on a GPU: its kernel updates bf16 weights in place too; a build without the
    // kernels says what it needs.
    let q8 = parse(&["--device", "cuda", "--optim", "adamw8bit"]).validate();
    if cfg!(feature = "cuda") && std::env::var("FT_CUDA_KERNELS").is_err() {
        assert!(q8.is_ok(), "{q8:?}");
    } else {
        let e = q8.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("CUDA kernels"), "{e}");
    }
}

/// Under `--full-bf16` the stochastic rounding follows `--seed`: the same seed rounds the same
/// weights the same way, another seed otherwise.
#[test]
fn full_bf16_rounding_follows_the_seed() -> anyhow::Result<()> {
    use candle_core::{DType, Device, Tensor, Var};
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        common: ft_trainer::train::CommonArgs,
    }
    let run = |seed: &str| -> anyhow::Result<Vec<u16>> {
        let c =
            Cli::parse_from(["t", "--full-bf16", "--seed", seed, "--optim", "adafactor"]).common;
        let w = Var::from_tensor(&Tensor::ones(512, DType::BF16, &Device::Cpu)?)?;
        let mut opt = c.optimizer(vec![("w".into(), w.clone())], c.planned_precision()?)?;
        let g = Tensor::ones(512, DType::BF16, &Device::Cpu)?;
        opt.step(vec![Some(g)], 1e-3)?;
        Ok(w.as_tensor()
            .to_vec1::<half::bf16>()?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    };
    assert_eq!(run("1")?, run("1")?);
    assert_ne!(run("1")?, run("2")?);
    Ok(())
}

/// A binary's arguments through the shared parser: its default model when `--model` is not
/// given (also by code that builds the arguments with clap alone), its `--demo` preset under
/// `--demo` and its defaults preset otherwise, both below a config file and the flags.
#[test]
fn a_binary_gets_its_default_model_and_its_presets() -> anyhow::Result<()> {
    use ft_trainer::train::{parse_args_from, Binary, CommonArgs};
    #[derive(Parser, Serialize, Deserialize, Debug)]
    struct Bin {
        #[arg(long, default_value_t = 3)]
        own: u32,
        #[command(flatten)]
        #[serde(flatten)]
        common: CommonArgs,
    }
    impl Binary for Bin {
        const DEFAULT_MODEL: Option<&'static str> = Some("org/default-model");
        const DEMO: (&'static str, &'static str) = ("demo preset", "own = 7\nbatch_size = 16\n");
        const DEFAULTS: Option<(&'static str, &'static str)> = Some(("defaults", "lr = 0.5\n"));
        fn common(&self) -> &CommonArgs {
            &self.common
        }
        fn common_mut(&mut self) -> &mut CommonArgs {
            &mut self.common
        }
    }
    let plain: Bin = parse_args_from(["bin"])?;
    assert_eq!(plain.model(), Some("org/default-model"));
    assert_eq!(
        (plain.own, plain.common.lr),
        (3, 0.5),
        "the defaults preset"
    );
    let demo: Bin = parse_args_from(["bin", "--demo", "--own", "9"])?;
    // What the user typed is recorded as given (--fit keeps it); the preset's settings are not.
    let given: Vec<&str> = demo.common.given.iter().map(|s| s.as_str()).collect();
    assert_eq!(given, ["demo", "own"]);
    assert_eq!(
        (demo.own, demo.common.batch_size),
        (9, 16),
        "flag over preset"
    );
    assert_eq!(
        demo.common.lr, 1e-4,
        "--demo takes the demo preset, not the defaults"
    );
    let named: Bin = parse_args_from(["bin", "--model", "my/model"])?;
    assert_eq!(named.model(), Some("my/model"));
    let built = Bin::parse_from(["bin"]);
    assert_eq!(built.model(), Some("org/default-model"), "clap alone");
    Ok(())
}

/// `--epochs 0` is refused (it trained one step) unless `--max-steps` decides; a flag beyond
/// TOML's integers (`--warmup-steps 18446744073709551615`) parses under a preset instead of an
/// error that blamed the preset.
#[test]
fn epochs_zero_and_flags_beyond_toml_integers() -> anyhow::Result<()> {
    #[derive(Parser, Serialize, Deserialize, Debug)]
    struct Cli {
        #[command(flatten)]
        #[serde(flatten)]
        common: ft_trainer::train::CommonArgs,
    }
    let e = Cli::parse_from(["t", "--epochs", "0"])
        .common
        .validate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("--epochs"), "{e}");
    Cli::parse_from(["t", "--epochs", "0", "--max-steps", "5"])
        .common
        .validate()?;
    let big = u64::MAX.to_string();
    let a: Cli = ft_trainer::train::config::parse_with_preset(
        ["t", "--warmup-steps", &big, "--seed", &big],
        |a: &Cli| a.common.config.clone(),
        |_| Some(("a preset", "lr = 0.5\n")),
    )?;
    assert_eq!((a.common.warmup_steps, a.common.seed), (u64::MAX, u64::MAX));
    assert_eq!(a.common.lr, 0.5);
    // A non-finite float cannot pass through the merge (JSON has no NaN): the flag is named,
    // not the preset.
    for (flag, value) in [("--weight-decay", "NaN"), ("--lr", "inf")] {
        let e = ft_trainer::train::config::parse_with_preset(
            ["t", flag, value],
            |a: &Cli| a.common.config.clone(),
            |_| Some(("a preset", "lr = 0.5\n")),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(
            e.contains(flag) && e.contains("finite") && !e.contains("preset"),
            "{e}"
        );
    }
    Ok(())
}
