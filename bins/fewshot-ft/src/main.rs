//! `fewshot-ft`: episodic few-shot training and testing (FSCT, ProtoNet).

use fewshot_ft::cli::Args;

#[global_allocator]
static ALLOC: ft_memory::alloc::CountingAlloc = ft_memory::alloc::CountingAlloc;

/// The paper's optimiser settings: the defaults unless a config file or flag says otherwise.
const DEFAULTS: &str = include_str!("../../../configs/fewshot_defaults.toml");
/// `--demo`: generated images, small episodes, a one-minute run.
const DEMO: &str = include_str!("../../../configs/fewshot_demo.toml");

fn main() -> anyhow::Result<()> {
    let args: Args = ft_memory::config::parse_with_preset(
        std::env::args_os(),
        |a: &Args| a.config.clone(),
        |a: &Args| {
            Some(if a.demo {
                ("configs/fewshot_demo.toml (built in)", DEMO)
            } else {
                ("configs/fewshot_defaults.toml (built in)", DEFAULTS)
            })
        },
    )?;
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
