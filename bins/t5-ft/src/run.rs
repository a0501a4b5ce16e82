//! From arguments to a finished run: resolve the model, load it once, build data, train.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::DType;
use ft_memory::checkpoint::Checkpointer;
use ft_memory::ledger::Ledger;
use ft_memory::train::{LoopConfig, RunSummary, Units};
use ft_memory::weights::{ModelRepo, ParamBuilder, ParamStore};
use ft_models::t5::{T5Config, T5};

use crate::cli::Args;
use crate::data::{Fields, RecordFile};
use crate::task::{Order, T5Task};
use crate::tokenize::Collator;

/// Everything a run needs, built from the arguments (also used by tests and benches).
pub type Setup = ft_memory::train::Session<T5Task>;

/// The arguments validated, the output folder created and, with `--demo`, the bundled task
/// written there and pointed to.
fn resolved(args: &Args) -> anyhow::Result<Args> {
    let mut args = args.clone();
    args.validate()?;
    let out = args.common.output_dir.clone();
    // `--plan` writes nothing, unless `--demo` has to write its model to plan it.
    if !args.common.plan || args.demo {
        std::fs::create_dir_all(&out).map_err(|e| anyhow::anyhow!("{}: {e}", out.display()))?;
    }
    if args.demo {
        let dir = out.join("demo-data");
        crate::demo::write(&dir, 2000, 64, args.common.seed)?;
        args.model = dir.join("model").display().to_string();
        args.train_file = Some(dir.join("train.jsonl"));
        args.eval_file = Some(dir.join("eval.jsonl"));
    }
    Ok(args)
}

/// `--plan`: the memory plan from the model's config.json alone (the model built from shapes,
/// no weights read, nothing allocated, no device opened).
pub fn plan(args: &Args) -> anyhow::Result<ft_memory::plan::StatePlan> {
    let args = resolved(args)?;
    let repo = ModelRepo::open(&args.model)?;
    let cfg = T5Config::from_file(&repo.get("config.json")?)?;
    let (pb, store, precision) = args.common.shapes_builder()?;
    let model = T5::new(&pb, &cfg)?;
    Ok(args
        .common
        .state_plan(&store, &model.segments(), precision)?)
}

/// Resolves model, data and optimizer. With `--demo`, first writes the bundled task.
pub fn setup(args: &Args) -> anyhow::Result<Setup> {
    let args = resolved(args)?;
    let out = args.common.output_dir.clone();
    let device = args.common.device()?;
    let precision = args.common.precision(&device)?;
    let mut ledger = Ledger::new(&device).with_timeline(out.join("memory.jsonl"))?;
    ledger.set_baseline();

    let repo = ModelRepo::open(&args.model)?;
    let cfg = T5Config::from_file(&repo.get("config.json")?)?;
    let tokenizer_path = repo.get("tokenizer.json")?;
    // Weights come from the checkpoint being resumed, else the model, else the seed.
    let weights = match &args.common.resume {
        Some(dir) => Some(ModelRepo::Local(dir.clone()).safetensors("model")?),
        None if repo.has("model.safetensors") || repo.has("model.safetensors.index.json") => {
            Some(repo.safetensors("model")?)
        }
        None => None,
    };
    let store = ParamStore::new();
    let mut pb = ParamBuilder::new(store.clone(), precision.storage, &device, args.common.seed);
    if let Some(files) = weights {
        pb = pb.with_source(Arc::new(files));
    }
    let model = T5::new(&pb, &cfg)?;
    ledger.mark("load", 0)?;
    let segments = model.segments();

    let fields = Fields {
        input: args.input_field.clone(),
        target: args.target_field.clone(),
        skip_bad: args.skip_bad_lines,
    };
    let train_path: PathBuf = args
        .train_file
        .clone()
        .ok_or_else(|| anyhow::anyhow!("--train-file is required"))?;
    let train_file = RecordFile::open(&train_path, fields.clone())?;
    if !train_file.skipped().is_empty() {
        eprintln!(
            "{}: skipped {} malformed records (first at line {})",
            train_path.display(),
            train_file.skipped().len(),
            train_file.skipped()[0].0
        );
    }
    let eval_file = match &args.eval_file {
        Some(p) => Some(RecordFile::open(p, fields)?),
        None => None,
    };
    let collator = Collator::from_file(
        &tokenizer_path,
        args.max_source_length,
        args.max_target_length,
        cfg.pad_token_id,
        cfg.vocab_size,
    )?;
    let order = Order {
        batch_size: args.common.batch_size,
        seed: args.common.seed,
        shuffle: true,
        group_by_length: args.group_by_length,
    };
    let mut task = T5Task::new(
        model,
        store.clone(),
        collator,
        train_file,
        eval_file,
        order,
        device,
        tokenizer_path,
    );
    task.max_new_tokens = args.max_new_tokens;
    task.eval_limit = args.eval_limit;

    args.common
        .announce_plan(&args.common.state_plan(&store, &segments, precision)?);
    let mut optimizer = args.common.optimizer(store.trainable()?, precision)?;
    // As HF Trainer: no weight decay for biases (T5's relative attention bias) and layer norms.
    optimizer.exempt_from_weight_decay(ft_memory::optim::hf_trainer_no_decay);
    let loop_config = LoopConfig {
        eval_every: args.eval_every,
        save_every: args.save_every,
        ..args
            .common
            .loop_config(Units::Tokens, task.batches_per_epoch())?
    };
    Ok(Setup {
        task,
        optimizer,
        ledger,
        loop_config,
        checkpointer: Checkpointer::new(args.common.gradient_checkpointing),
    })
}

/// Trains as the arguments say and prints the memory table.
pub fn run(args: &Args) -> anyhow::Result<RunSummary> {
    let mut s = setup(args)?;
    let (n, bytes) = s.task.store.count(true);
    eprintln!(
        "t5-ft: {n} trainable parameters ({}), {} steps, precision {:?}",
        ft_memory::ledger::format_bytes(bytes as i64),
        s.loop_config.max_steps,
        s.optimizer
            .params()
            .first()
            .map(|p| p.dtype())
            .unwrap_or(DType::F32)
    );
    let summary = s.train()?;
    eprintln!("{}", s.ledger.table());
    if let Some(dir) = &summary.final_dir {
        eprintln!("model saved in {} (Hugging Face layout)", dir.display());
    }
    Ok(summary)
}
