//! From arguments to a finished run: resolve the model, load it once, build data, train.

use std::path::PathBuf;

use ft_models::activations::{T5Shape, Target};
use ft_models::t5::{T5Config, T5};
use ft_params::bytes::format_bytes;
use ft_params::ParamStore;
use ft_trainer::optim::hf_trainer_no_decay;
use ft_trainer::train::plan::StatePlan;
use ft_trainer::train::{ranks, ModelRepo};
use ft_trainer::train::{
    Binary, EpochOrder, Grouping, LoopPlan, RunSummary, SessionBuilder, Units,
};
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
        // Rank 0 writes the demo; the other ranks of a data-parallel run read it.
        ranks::main_first(|| crate::demo::write(&dir, 2000, 64, args.common.seed))?;
        args.common.model = Some(dir.join("model").display().to_string());
        // The demo's tiny model has a config and a tokenizer, no weights.
        args.from_scratch = true;
        // The demo's data unless files are given (the demo model on one's own data).
        args.train_file
            .get_or_insert_with(|| dir.join("train.jsonl"));
        args.eval_file.get_or_insert_with(|| dir.join("eval.jsonl"));
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
    let (repo, cfg) = model_config(&args)?;
    let (pb, store, precision) = args.common.shapes_builder()?;
    let model = T5::new(&pb, &cfg)?;
    let lengths = match &args.train_file {
        Some(path) => {
            let collator = collator(&args, &repo.get("tokenizer.json")?, &cfg)?;
            let train = RecordFile::open(path, fields(&args))?;
            Some(longest(&train, &collator)?)
        }
        None => None,
    };
    t5_plan(&args, &store, &model, precision, lengths)
}

/// Records read by [`longest`] at most: a larger file is read on its longest records by bytes.
const LENGTH_SCAN: usize = 20_000;

/// The longest source and target among `train`'s records, in tokens after truncation: a batch
/// pads to its longest, so no batch of the run holds more. A file of more than [`LENGTH_SCAN`]
/// records is read on that many of its longest by bytes, which hold the longest in tokens but
/// for an odd record.
fn longest(train: &RecordFile, collator: &Collator) -> anyhow::Result<(usize, usize)> {
    let mut idx: Vec<usize> = (0..train.len()).collect();
    if idx.len() > LENGTH_SCAN {
        idx.sort_by_key(|&i| std::cmp::Reverse(train.byte_len(i)));
        idx.truncate(LENGTH_SCAN);
    }
    let (mut source, mut target) = (1, 1);
    for chunk in idx.chunks(1024) {
        for e in train.read(chunk)? {
            source = source.max(collator.encode_source(&e.input)?.len());
            target = target.max(collator.encode_target(&e.target)?.len());
        }
    }
    Ok((source, target))
}

fn collator(args: &Args, tokenizer: &std::path::Path, cfg: &T5Config) -> anyhow::Result<Collator> {
    Collator::from_file(
        tokenizer,
        args.max_source_length,
        args.max_target_length,
        cfg.pad_token_id,
        cfg.vocab_size,
    )
}

/// The model states under these arguments and the activations of one micro-batch of the
/// training data's longest source and target (`lengths`, from [`longest`]), else padded to
/// `--max-source-length` and `--max-target-length` (the most a batch can hold), with dropout
/// when the config has it.
fn t5_plan(
    args: &Args,
    store: &ParamStore,
    model: &T5,
    precision: Precision,
    lengths: Option<(usize, usize)>,
) -> anyhow::Result<StatePlan> {
    let plan = args
        .common
        .state_plan(store, &model.segments(), precision)?;
    let (source_len, target_len) =
        lengths.unwrap_or((args.max_source_length, args.max_target_length));
    let shape = T5Shape {
        batch: args.common.batch_size,
        source_len,
        target_len,
    };
    let target = Target::of_device(&args.common.device);
    let profile = model
        .config()
        .activations(&shape, precision.storage, target, true);
    let what = format!(
        "batch {} x {} + {} tokens, {}",
        shape.batch,
        shape.source_len,
        shape.target_len,
        if lengths.is_some() {
            "the training data's longest"
        } else {
            "the maximum lengths"
        }
    );
    Ok(args.common.with_activations(plan, &what, &profile)?)
}

/// Resolves model, data and optimizer. With `--demo`, first writes the bundled task.
pub fn setup(args: &Args) -> anyhow::Result<Setup> {
    // The folder is this run's before the demo's files are written into it.
    args.validate()?;
    let lock = ranks::lock_output(&args.common.output_dir)?;
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
    let (train_file, eval_file) = record_files(&args)?;
    let collator = collator(&args, &tokenizer_path, &cfg)?;
    let lengths = longest(&train_file, &collator)?;
    let plan = t5_plan(&args, s.store(), &model, s.precision(), Some(lengths))?;
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
    let fields = fields(args);
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

fn fields(args: &Args) -> Fields {
    Fields {
        input: args.input_field.clone(),
        target: args.target_field.clone(),
        skip_bad: args.skip_bad_lines,
    }
}

/// Trains as the arguments say and prints the memory table.
pub fn run(args: &Args) -> anyhow::Result<RunSummary> {
    let mut s = setup(args)?;
    let (n, bytes) = s.task.store.count(true);
    // Rank 0 reports for a data-parallel run.
    let main = ranks::is_main()?;
    if main {
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
    }
    let summary = s.train()?;
    if !main {
        return Ok(summary);
    }
    eprintln!("{}", s.ledger.table());
    if let Some(dir) = &summary.final_dir {
        eprintln!("model saved in {} (Hugging Face layout)", dir.display());
    }
    Ok(summary)
}
