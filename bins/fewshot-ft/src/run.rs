//! From arguments to a trained and tested model.

use ft_models::activations::{EpisodeShape as ActivationShape, Target};
use ft_models::fewshot::{Backbone, BackboneKind, FewShotModel, Method};
use ft_params::bytes::format_bytes;
use ft_params::ParamStore;
use ft_trainer::train::plan::StatePlan;
use ft_trainer::train::{
    ranks, BestConfig, LoopPlan, ModelRepo, RunSummary, SessionBuilder, Units,
};
use ft_trainer::update::Precision;

use crate::cli::Args;
use crate::data::{EpisodeShape, ImageConfig, SplitPlan, Splits};
use crate::task::{Accuracy, FewShotTask};

/// Everything a run needs, built from the arguments (also used by tests and benches).
pub type Setup = ft_trainer::train::Session<FewShotTask>;

/// Backbone, method and image side the arguments choose (84 px for Conv backbones, 224 for
/// ResNets unless `--image-size`).
fn model_spec(args: &Args) -> anyhow::Result<(BackboneKind, Method, usize)> {
    let kind: BackboneKind = args.backbone.parse()?;
    let method: Method = args.method.parse()?;
    let size = args.image_size.unwrap_or(match kind {
        BackboneKind::Conv4 | BackboneKind::Conv6 => 84,
        _ => 224,
    });
    Ok((kind, method, size))
}

/// `--plan`: the memory plan of the model the arguments choose, built from shapes (nothing
/// allocated, no device opened).
pub fn plan(args: &Args) -> anyhow::Result<StatePlan> {
    args.validate()?;
    let (kind, method, size) = model_spec(args)?;
    let (pb, store, precision) = args.common.shapes_builder()?;
    let backbone = Backbone::new(&pb, kind, size, !args.pooled)?;
    let model = FewShotModel::new(&pb, backbone, method, args.n_way, args.k_shot)?;
    fewshot_plan(args, &store, &model, size, precision)
}

/// The model states under these arguments and the activations of one training episode.
fn fewshot_plan(
    args: &Args,
    store: &ParamStore,
    model: &FewShotModel,
    image_size: usize,
    precision: Precision,
) -> anyhow::Result<StatePlan> {
    let plan = args
        .common
        .state_plan(store, &model.segments(), precision)?;
    let shape = ActivationShape {
        n_way: args.n_way,
        k_shot: args.k_shot,
        n_query: args.n_query,
        image_size,
    };
    let target = Target::of_device(&args.common.device);
    let profile = model.activations(&shape, precision.storage, target);
    let what = format!(
        "episode {}-way {}-shot + {} queries, {image_size} px",
        shape.n_way, shape.k_shot, shape.n_query
    );
    Ok(args.common.with_activations(plan, &what, &profile)?)
}

/// Data, model and optimizer from the arguments; `--demo` uses generated images.
pub fn setup(args: &Args) -> anyhow::Result<Setup> {
    args.validate()?;
    let (kind, method, size) = model_spec(args)?;
    let splits = if args.common.demo {
        Splits::synthetic(40, 40, args.common.seed)
    } else {
        let dir = args
            .data_dir
            .clone()
            .ok_or_else(|| anyhow::anyhow!("--data-dir is required"))?;
        let plan = SplitPlan {
            n_way: args.n_way,
            validate: args.val_episodes > 0,
        };
        Splits::from_dir(&dir, args.common.seed, plan)?
    };
    if let Some(note) = &splits.note {
        eprintln!("{note}");
    }
    let shape = EpisodeShape {
        n_way: args.n_way,
        k_shot: args.k_shot,
        n_query: args.n_query,
    };
    splits.check(shape.n_way, shape.k_shot + shape.n_query)?;

    let mut s = SessionBuilder::new(&args.common)?;
    // Weights come from the checkpoint being resumed, else a saved model, else the seed.
    let weights = match (s.resumed_weights("model")?, &args.common.model) {
        (Some(w), _) => Some(w),
        (None, Some(dir)) => Some(ModelRepo::open(dir)?.safetensors("model")?),
        (None, None) => None,
    };
    let pb = s.params(weights);
    let backbone = Backbone::new(&pb, kind, size, !args.pooled)?;
    let model = FewShotModel::new(&pb, backbone, method, shape.n_way, shape.k_shot)?;
    s.loaded()?;
    let config_json = serde_json::json!({
        "backbone": args.backbone, "method": args.method, "n_way": shape.n_way, "k_shot": shape.k_shot,
        "image_size": size, "flatten": !args.pooled,
    });
    let task = FewShotTask::new(
        model,
        s.store().clone(),
        splits,
        shape,
        ImageConfig {
            size,
            augment: args.augment,
        },
        ImageConfig {
            size,
            augment: false,
        },
        s.device().clone(),
        args.common.seed,
        args.n_episode,
        args.val_episodes,
        config_json,
    );
    let plan = fewshot_plan(args, s.store(), &task.model, size, s.precision())?;
    let optimizer = s.optimizer(&plan)?;
    // Validation and a checkpoint after every epoch, the best one kept.
    let steps_per_epoch = args.n_episode.div_ceil(args.common.accum) as u64;
    let plan = LoopPlan {
        eval_every: steps_per_epoch,
        save_every: steps_per_epoch,
        best: Some(BestConfig {
            metric: "accuracy".into(),
            higher_is_better: true,
            patience: args.patience,
        }),
        ..LoopPlan::new(Units::Samples, args.n_episode)
    };
    Ok(s.session(task, optimizer, plan)?)
}

/// What a finished run reports.
pub struct Outcome {
    pub summary: RunSummary,
    pub test: Accuracy,
}

/// Trains, keeps the best validation checkpoint, and tests it on `--test-episodes` episodes.
/// In a data-parallel run rank 0 tests and reports; the other ranks return `None`.
pub fn run(args: &Args) -> anyhow::Result<Option<Outcome>> {
    let mut s = setup(args)?;
    let (n, bytes) = s.task.store.count(true);
    let main = ranks::is_main()?;
    if main {
        eprintln!(
            "fewshot-ft: {} {} {}-way {}-shot, {n} trainable parameters ({}), {} steps",
            args.backbone,
            args.method,
            args.n_way,
            args.k_shot,
            format_bytes(bytes as i64),
            s.loop_config.max_steps
        );
    }
    let summary = s.train()?;
    if !main {
        return Ok(None);
    }
    if let Some((acc, dir)) = &summary.best {
        eprintln!(
            "best validation accuracy {acc:.2}% ({}); testing it",
            dir.display()
        );
        s.task.load_weights(dir)?;
    } else if args.val_episodes == 0 {
        eprintln!("no validation (--val-episodes 0): testing the last model");
    }
    s.ledger.mark("eval/before", summary.steps)?;
    let test = s.task.accuracy(
        &s.task.splits.test,
        args.test_episodes,
        args.common.seed ^ 0x7E57,
    )?;
    s.ledger.mark("eval/after", summary.steps)?;
    eprintln!("{}", s.ledger.table());
    let result = serde_json::json!({
        "test_accuracy": test.mean, "test_ci95": test.ci95, "test_episodes": test.episodes,
        "best_val_accuracy": summary.best.as_ref().map(|b| b.0), "steps": summary.steps,
        "stopped_early": summary.stopped_early,
    });
    let path = args.common.output_dir.join("results.json");
    ft_params::fs::write_atomic(&path, |f| {
        std::io::Write::write_all(f, result.to_string().as_bytes())
    })?;
    Ok(Some(Outcome { summary, test }))
}
