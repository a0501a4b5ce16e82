//! From arguments to a finished run: resolve the model, load it once, build data, train.

use std::path::PathBuf;

use ft_models::activations::{T5Shape, Target};
use ft_models::t5::{T5Config, T5};
use ft_params::bytes::format_bytes;
use ft_params::ParamStore;
use ft_trainer::optim::hf_trainer_no_decay;
use ft_trainer::train::plan::StatePlan;
use ft_trainer::train::{
    Binary, EpochOrder, Grouping, LoopPlan, RunSummary, SessionBuilder, Units,
};
use ft_trainer::train::{FolderLock, ModelRepo};
use ft_trainer::update::Precision;

use crate::cli::Args;
use crate::data::{Fields, RecordFile};
use crate::task::T5Task;
use crate::tokenize::Collator;

/// Everything a run needs, built from the arguments (also used by tests and benches).
pub type Setup = ft_trainer::train::Session<T5Task>;

/// The arguments validated, the output folder created and, with `--demo`, the bundled task
/// written there and pointed to.
fn resolved(args: &Args) -> anyhow::Result<Args> {
    let mut args = args.clone();
    args.validate()?;
    let out = args.common.create_output_dir()?;
    if args.common.demo {
        let dir = out.join("demo-data");
        crate::demo::write(&dir, 2000, 64, args.common.seed)?;
        args.common.model = Some(dir.join("model").display().to_string());
        // The demo's tiny model has a config and a tokenizer, no weights.
        args.from_scratch = true;
        args.train_file = Some(dir.join("train.jsonl"));
        args.eval_file = Some(dir.join("eval.jsonl"));
    }
    Ok(args)
}

/// The model folder or hub repository the arguments name, and its config.
fn model_config(args: &Args) -> anyhow::Result<(ModelRepo, T5Config)> {
    let repo = ModelRepo::open(args.model().unwrap_or_default())?;
    let cfg = T5Config::from_file(&repo.get("config.json")?)?;
    Ok((repo, cfg))
}

/// `--plan`: the memory plan from the model's config.json alone (the model built from shapes,
/// no weights read, nothing allocated, no device opened).
pub fn plan(args: &Args) -> anyhow::Result<StatePlan> {
    let args = resolved(args)?;
    let (_, cfg) = model_config(&args)?;
    let (pb, store, precision) = args.common.shapes_builder()?;
    let model = T5::new(&pb, &cfg)?;
    t5_plan(&args, &store, &model, precision)
}

/// The model states under these arguments and the activations of one micro-batch padded to
/// `--max-source-length` and `--max-target-length` (the most a batch can hold), with dropout
/// when the config has it.
fn t5_plan(
    args: &Args,
    store: &ParamStore,
    model: &T5,
    precision: Precision,
) -> anyhow::Result<StatePlan> {
    let plan = args
        .common
        .state_plan(store, &model.segments(), precision)?;
    let shape = T5Shape {
        batch: args.common.batch_size,
        source_len: args.max_source_length,
        target_len: args.max_target_length,
    };
    let target = Target::of_device(&args.common.device);
    let profile = model
        .config()
        .activations(&shape, precision.storage, target, true);
    let what = format!(
        "batch {} x {} + {} tokens",
        shape.batch, shape.source_len, shape.target_len
    );
    Ok(args.common.with_activations(plan, &what, &profile)?)
}

/// Resolves model, data and optimizer. With `--demo`, first writes the bundled task.
pub fn setup(args: &Args) -> anyhow::Result<Setup> {
    // The folder is this run's before the demo's files are written into it.
    args.validate()?;
    let lock = FolderLock::acquire(&args.common.output_dir)?;
    let args = resolved(args)?;
    let mut s = SessionBuilder::with_lock(&args.common, lock)?;
    let (repo, cfg) = model_config(&args)?;
    let tokenizer_path = repo.get("tokenizer.json")?;
    // Weights come from the checkpoint being resumed, else the model's own (an error when it has
    // none), else, with --from-scratch only, the seed.
    let weights = match s.resumed_weights("model")? {
        Some(w) => Some(w),
        None if args.from_scratch => None,
        None => match repo.safetensors_if_present("model")? {
            Some(w) => Some(w),
            None => anyhow::bail!(
                "{}; --from-scratch trains from the seed's random weights instead",
                repo.missing_weights("model")
            ),
        },
    };
    let model = T5::new(&s.params(weights), &cfg)?;
    s.loaded()?;
    let plan = t5_plan(&args, s.store(), &model, s.precision())?;

    let (train_file, eval_file) = record_files(&args)?;
    let collator = Collator::from_file(
        &tokenizer_path,
        args.max_source_length,
        args.max_target_length,
        cfg.pad_token_id,
        cfg.vocab_size,
    )?;
    let order = EpochOrder {
        items: train_file.len(),
        batch_size: args.common.batch_size,
        seed: args.common.seed,
        shuffle: !args.no_shuffle,
        grouping: if args.group_by_length {
            Grouping::ByLength(
                (0..train_file.len())
                    .map(|i| train_file.byte_len(i))
                    .collect(),
            )
        } else {
            Grouping::None
        },
    };
    let mut task = T5Task::new(
        model,
        s.store().clone(),
        collator,
        train_file,
        eval_file,
        order,
        s.device().clone(),
        tokenizer_path,
    );
    task.max_new_tokens = args.max_new_tokens;
    task.eval_limit = args.eval_limit;

    let mut optimizer = s.optimizer(&plan)?;
    // As HF Trainer: no weight decay for biases (T5's relative attention bias) and layer norms.
    optimizer.exempt_from_weight_decay(hf_trainer_no_decay);
    let batches = task.batches_per_epoch();
    Ok(s.session(task, optimizer, LoopPlan::new(Units::Tokens, batches))?)
}

/// The training file (its malformed records reported when skipped) and the evaluation file.
fn record_files(args: &Args) -> anyhow::Result<(RecordFile, Option<RecordFile>)> {
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
    Ok((train_file, eval_file))
}

/// Trains as the arguments say and prints the memory table.
pub fn run(args: &Args) -> anyhow::Result<RunSummary> {
    let mut s = setup(args)?;
    let (n, bytes) = s.task.store.count(true);
    eprintln!(
        "t5-ft: {n} trainable parameters ({}), {} steps, precision {:?}",
        format_bytes(bytes as i64),
        s.loop_config.max_steps,
        s.optimizer
            .params()
            .first()
            .map(|p| p.dtype())
            .unwrap_or(candle_core::DType::F32)
    );
    let summary = s.train()?;
    eprintln!("{}", s.ledger.table());
    if let Some(dir) = &summary.final_dir {
        eprintln!("model saved in {} (Hugging Face layout)", dir.display());
    }
    Ok(summary)
}
