//! `t5-ft`: FLAN-T5 seq2seq full fine-tune.

use t5_ft::cli::Args;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

fn main() -> anyhow::Result<()> {
    let args: Args = ft_trainer::train::parse_args()?;
    if args.common.plan {
        print!("{}", t5_ft::run::plan(&args)?.report());
        return Ok(());
    }
    eprint!("{}", t5_ft::run::run(&args)?.report());
    Ok(())
}
