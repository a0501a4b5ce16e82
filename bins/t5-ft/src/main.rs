//! `t5-ft`: FLAN-T5 seq2seq full fine-tune.

use t5_ft::cli::Args;

#[global_allocator]
static ALLOC: ft_memory::alloc::CountingAlloc = ft_memory::alloc::CountingAlloc;

fn main() -> anyhow::Result<()> {
    let args: Args = ft_memory::config::parse(|a: &Args| a.config.clone())?;
    let summary = t5_ft::run::run(&args)?;
    if let (Some(first), Some(last)) = (summary.losses.first(), summary.losses.last()) {
        eprintln!("loss {first:.4} -> {last:.4} over {} steps", summary.steps);
    }
    for (k, v) in &summary.last_eval {
        eprintln!("eval {k}: {v:.4}");
    }
    Ok(())
}
