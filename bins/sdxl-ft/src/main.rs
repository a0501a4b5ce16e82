//! `sdxl-ft`: full fine-tune of the SDXL UNet with cached conditioning, EMA off the device and
//! chunked VAE decode.

use ft_trainer::train::ranks;
use sdxl_ft::cli::Args;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

fn main() -> anyhow::Result<()> {
    // One process, or one rank of `mpirun -np N`: a failing rank ends them all.
    ranks::main(|| {
        let args: Args = ft_trainer::train::parse_args()?;
        // --fit: the settings the plan predicts fit, chosen before anything is built.
        let args = ft_trainer::train::fit::apply(args, sdxl_ft::run::plan)?;
        if args.common.plan {
            let plan = sdxl_ft::run::plan(&args)?;
            if ranks::is_main()? {
                print!("{}", plan.report());
            }
            return Ok(());
        }
        let summary = sdxl_ft::run::run(&args)?;
        ranks::say(summary.report());
        Ok(())
    })
}
