//! `t5-ft`: FLAN-T5 seq2seq full fine-tune.

use ft_trainer::train::ranks;
use t5_ft::cli::Args;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

fn main() -> anyhow::Result<()> {
    // One process, or one rank of `mpirun -np N`: a failing rank ends them all.
    ranks::main(|| {
        let args: Args = ft_trainer::train::parse_args()?;
        // --fit: the settings the plan predicts fit, chosen before anything is built.
        let args = ft_trainer::train::fit::apply(args, t5_ft::run::plan)?;
        if args.common.plan {
            let plan = t5_ft::run::plan(&args)?;
            if ranks::is_main()? {
                print!("{}", plan.report());
            }
            return Ok(());
        }
        let summary = t5_ft::run::run(&args)?;
        ranks::say(summary.report());
        Ok(())
    })
}
