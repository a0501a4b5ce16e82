//! `fewshot-ft`: episodic few-shot training and testing (FSCT, ProtoNet).

use fewshot_ft::cli::Args;
use ft_trainer::train::ranks;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

fn main() -> anyhow::Result<()> {
    // One process, or one rank of `mpirun -np N`: a failing rank ends them all.
    ranks::main(|| {
        let args: Args = ft_trainer::train::parse_args()?;
        // --fit: the settings the plan predicts fit, chosen before anything is built.
        let args = ft_trainer::train::fit::apply(args, fewshot_ft::run::plan)?;
        if args.common.plan {
            let plan = fewshot_ft::run::plan(&args)?;
            if ranks::is_main()? {
                print!("{}", plan.report());
            }
            return Ok(());
        }
        // Rank 0 tests and reports.
        if let Some(out) = fewshot_ft::run::run(&args)? {
            eprintln!(
                "test accuracy {:.2}% +- {:.2}% over {} episodes ({}-way {}-shot; chance {:.0}%)",
                out.test.mean,
                out.test.ci95,
                out.test.episodes,
                args.n_way,
                args.k_shot,
                100.0 / args.n_way as f64
            );
        }
        Ok(())
    })
}
