//! `t5-ft`: FLAN-T5 seq2seq full fine-tune.

use t5_ft::cli::Args;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

fn main() -> anyhow::Result<()> {
    let args: Args = ft_trainer::train::parse_args()?;
    // --fit: the settings the plan predicts fit, chosen before anything is built.
    let args = ft_trainer::train::fit::apply(args, t5_ft::run::plan)?;
    if args.common.plan {
        print!("{}", t5_ft::run::plan(&args)?.report());
        return Ok(());
    }
    eprint!("{}", t5_ft::run::run(&args)?.report());
    Ok(())
}
