//! `t5-ft`: FLAN-T5 seq2seq full fine-tune.

use t5_ft::cli::Args;

#[global_allocator]
static ALLOC: ft_memory::alloc::CountingAlloc = ft_memory::alloc::CountingAlloc;

/// `--demo` without `--config` starts from these settings (flags still override them).
const DEMO: &str = include_str!("../../../configs/t5_demo.toml");

fn main() -> anyhow::Result<()> {
    let args: Args = ft_memory::config::parse_with_preset(
        std::env::args_os(),
        |a: &Args| a.config.clone(),
        |a: &Args| a.demo.then_some(("configs/t5_demo.toml (built in)", DEMO)),
    )?;
    if args.common.plan {
        print!("{}", t5_ft::run::plan(&args)?.report());
        return Ok(());
    }
    let summary = t5_ft::run::run(&args)?;
    if let (Some(first), Some(last)) = (summary.losses.first(), summary.losses.last()) {
        eprintln!("loss {first:.4} -> {last:.4} over {} steps", summary.steps);
    }
    for (k, v) in &summary.last_eval {
        eprintln!("eval {k}: {v:.4}");
    }
    Ok(())
}
