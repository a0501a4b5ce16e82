//! `fewshot-ft`: episodic few-shot training and testing (FSCT, ProtoNet).

use fewshot_ft::cli::Args;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

fn main() -> anyhow::Result<()> {
    let args: Args = ft_trainer::train::parse_args()?;
    // --fit: the settings the plan predicts fit, chosen before anything is built.
    let args = ft_trainer::train::fit::apply(args, fewshot_ft::run::plan)?;
    if args.common.plan {
        print!("{}", fewshot_ft::run::plan(&args)?.report());
        return Ok(());
    }
    let out = fewshot_ft::run::run(&args)?;
    eprintln!(
        "test accuracy {:.2}% +- {:.2}% over {} episodes ({}-way {}-shot; chance {:.0}%)",
        out.test.mean,
        out.test.ci95,
        out.test.episodes,
        args.n_way,
        args.k_shot,
        100.0 / args.n_way as f64
    );
    Ok(())
}
