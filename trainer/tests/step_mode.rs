//! How a step is taken is decided once, where the flags are read: each combination no run can
//! satisfy is refused by name, and the loop follows what is left.

use clap::Parser;
use ft_trainer::train::CommonArgs;
use ft_trainer::update::{StepMode, StepModeRequest};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
}

fn mode(args: &[&str]) -> ft_trainer::Result<StepMode> {
    let mut v = vec!["t"];
    v.extend(args);
    let c = Cli::parse_from(v).common;
    c.validate()?;
    c.step_mode()
}

fn refused(args: &[&str], says: &str) {
    let e = mode(args).unwrap_err().to_string();
    assert!(e.contains(says), "{args:?}: {e}");
}

#[test]
fn step_modes_from_the_flags() -> anyhow::Result<()> {
    let plain = mode(&[])?;
    assert_eq!((plain.micro_batches(), plain.fused_backward()), (1, false));
    assert_eq!(plain, StepMode::plain());
    let acc = mode(&["--accum", "16"])?;
    assert_eq!((acc.micro_batches(), acc.fused_backward()), (16, false));
    let fused = mode(&["--fused-backward", "--gradient-checkpointing"])?;
    assert_eq!((fused.micro_batches(), fused.fused_backward()), (1, true));
    // With accumulation: segment by segment into the sums, then into the update.
    let fused = mode(&[
        "--fused-backward",
        "--checkpointing",
        "blocks",
        "--accum",
        "16",
    ])?;
    assert_eq!((fused.micro_batches(), fused.fused_backward()), (16, true));
    let bf16 = mode(&[
        "--fused-backward",
        "--gradient-checkpointing",
        "--full-bf16",
    ])?;
    assert!(bf16.fused_backward());
    // Any strategy that runs the model as segments carries a fused backward pass.
    for s in ["blocks", "full", "every:2", "budget:1GiB"] {
        assert!(mode(&["--fused-backward", "--checkpointing", s])?.fused_backward());
    }
    Ok(())
}

#[test]
fn checkpointing_strategies_from_the_flags() -> anyhow::Result<()> {
    use ft_params::checkpoint::Strategy;
    let strategy = |args: &[&str]| -> ft_trainer::Result<Strategy> {
        let mut v = vec!["t"];
        v.extend(args);
        let c = Cli::parse_from(v).common;
        c.validate()?;
        c.checkpoint_strategy()
    };
    assert_eq!(strategy(&[])?, Strategy::None);
    assert_eq!(strategy(&["--gradient-checkpointing"])?, Strategy::Full);
    assert_eq!(strategy(&["--checkpointing", "blocks"])?, Strategy::Blocks);
    assert_eq!(
        strategy(&["--checkpointing", "full-host"])?,
        Strategy::FullHost
    );
    assert_eq!(Strategy::FullHost.to_string(), "full-host");
    assert_eq!(
        strategy(&["--checkpointing", "full", "--gradient-checkpointing"])?,
        Strategy::Full
    );
    assert_eq!(
        strategy(&["--checkpointing", "budget:300MiB"])?,
        Strategy::Budget(300 << 20)
    );
    let e = strategy(&["--checkpointing", "blocks", "--gradient-checkpointing"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("give one of the two"), "{e}");
    let e = strategy(&["--checkpointing", "every:0"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("--checkpointing `every:0`"), "{e}");
    Ok(())
}

#[test]
fn impossible_step_modes_name_what_stands_in_the_way() {
    refused(&["--accum", "0"], "--accum");
    refused(&["--fused-backward"], "--gradient-checkpointing");
    refused(
        &["--fused-backward", "--checkpointing", "none"],
        "--checkpointing blocks",
    );
    refused(
        &[
            "--fused-backward",
            "--gradient-checkpointing",
            "--precision",
            "f16",
        ],
        "f16",
    );
    // The same rule from the update layer's side: one constructor, one check.
    let r = StepMode::new(StepModeRequest {
        micro_batches: 1,
        fused_backward: true,
        checkpointing: true,
        loss_scaling: true,
    });
    assert!(r.is_err());
}
