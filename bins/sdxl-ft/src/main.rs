//! `sdxl-ft`: full fine-tune of the SDXL UNet with cached conditioning, EMA off the device and
//! chunked VAE decode.

use sdxl_ft::cli::Args;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

fn main() -> anyhow::Result<()> {
    let args: Args = ft_trainer::train::parse_args()?;
    // --fit: the settings the plan predicts fit, chosen before anything is built.
    let args = ft_trainer::train::fit::apply(args, sdxl_ft::run::plan)?;
    if args.common.plan {
        print!("{}", sdxl_ft::run::plan(&args)?.report());
        return Ok(());
    }
    eprint!("{}", sdxl_ft::run::run(&args)?.report());
    Ok(())
}
