//! fewshot-ft end to end on CPU: the demo learns far above chance (an untrained model does not),
//! episode accumulation equals one big step, and bad data gets one clear error.

use std::path::Path;

use candle_core::{DType, Device, Var};
use clap::Parser;
use fewshot_ft::cli::Args;
use fewshot_ft::data::{sample_episode, EpisodeShape, ImageConfig, SplitPlan, Splits};
use fewshot_ft::run::{setup, Outcome};
use ft_params::checkpoint::Checkpointer;
use ft_trainer::scratch::Scratch;
use ft_trainer::update::{GradAccumulator, LossNorm};

/// A run's outcome (one process: rank 0's).
fn run(args: &Args) -> anyhow::Result<Outcome> {
    fewshot_ft::run::run(args)?.ok_or_else(|| anyhow::anyhow!("a single process reports"))
}

fn tmp(tag: &str) -> Scratch {
    Scratch::new(&format!("fewshot-{tag}"))
}

/// The demo's settings (configs/fewshot_demo.toml) with fewer episodes, for test time.
fn demo(out: &Path, extra: &[&str]) -> Args {
    let has = |k: &str| extra.contains(&k);
    let mut v: Vec<String> = [
        "fewshot-ft",
        "--demo",
        "--quiet",
        "--image-size",
        "28",
        "--n-query",
        "6",
        "--test-episodes",
        "100",
        "--weight-decay",
        "1e-5",
        "--max-grad-norm",
        "0",
        "--output-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(out.display().to_string());
    for (k, default) in [
        ("--lr", "1e-3"),
        ("--n-episode", "15"),
        ("--epochs", "2"),
        ("--val-episodes", "10"),
    ] {
        if !has(k) {
            v.extend([k.to_string(), default.to_string()]);
        }
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    Args::parse_from(v)
}

#[test]
fn demo_learns_far_above_chance_and_an_untrained_model_does_not() -> anyhow::Result<()> {
    let out = tmp("demo");
    let trained = run(&demo(&out, &[]))?;
    println!("trained: {:?}", trained.test);
    assert!(
        trained.test.mean > 40.0,
        "5-way 1-shot test accuracy {:.1}% is not clearly above chance",
        trained.test.mean
    );
    assert!(
        out.join("best").join("model.safetensors").is_file(),
        "best checkpoint kept"
    );
    assert!(out.join("results.json").is_file());
    // Without validation (--val-episodes 0) there is no best checkpoint: the last model is tested.
    let untrained_out = tmp("untrained");
    let untrained = run(&demo(
        &untrained_out,
        &[
            "--lr",
            "1e-12",
            "--n-episode",
            "1",
            "--epochs",
            "1",
            "--val-episodes",
            "0",
        ],
    ))?;
    println!("untrained: {:?}", untrained.test);
    assert!(untrained.summary.best.is_none());
    assert!(!untrained_out.join("best").exists());
    assert!(
        untrained.test.mean < 30.0,
        "an untrained FSCT must not reach the margin: {:.1}%",
        untrained.test.mean
    );
    // `--model` starts from the saved best model instead of the seed: with (almost) no further
    // training it tests as the trained run did, where the seed's weights test at chance.
    let best = out.join("best").display().to_string();
    let started = run(&demo(
        &tmp("from-best"),
        &[
            "--model",
            &best,
            "--lr",
            "1e-12",
            "--n-episode",
            "1",
            "--epochs",
            "1",
        ],
    ))?;
    println!("from best/: {:?}", started.test);
    assert!(
        (started.test.mean - trained.test.mean).abs() < 2.0,
        "from best/: {:.1}% against the trained run's {:.1}%",
        started.test.mean,
        trained.test.mean
    );
    Ok(())
}

type Weights = Vec<(String, Vec<f32>)>;

/// The weights (batch-norm running statistics included) before and after a short run.
fn trained_weights(extra: &[&str]) -> anyhow::Result<(Weights, Weights)> {
    let mut args = vec!["--n-episode", "4", "--epochs", "1", "--val-episodes", "0"];
    args.extend_from_slice(extra);
    let out = tmp(&format!("ck{}", extra.join("").replace(['-', ':'], "")));
    let mut s = setup(&demo(&out, &args))?;
    let read = |s: &fewshot_ft::run::Setup| -> anyhow::Result<Weights> {
        let mut w = Vec::new();
        for (name, t) in s.task.store.all() {
            w.push((name, t.flatten_all()?.to_vec1::<f32>()?));
        }
        Ok(w)
    };
    let before = read(&s)?;
    s.train()?;
    let after = read(&s)?;
    Ok((before, after))
}

/// The backbone's blocks run as checkpoint segments: every strategy, and the fused backward
/// with episode accumulation, trains to the same weights and running statistics as plain
/// backprop, bit for bit (a recomputed block reads the batch's statistics again without moving
/// the running ones a second time).
#[test]
fn every_checkpointing_strategy_trains_to_plain_backprops_weights() -> anyhow::Result<()> {
    for backbone in ["conv4", "resnet10"] {
        let base = ["--backbone", backbone, "--accum", "2"];
        let (init, plain) = trained_weights(&base)?;
        // Training moved every tensor, the running statistics included (but the prototype
        // weights: a softmax over one shot is 1 whatever its logit, so its gradient is 0).
        for ((name, a), (_, b)) in init.iter().zip(&plain) {
            assert!(
                a != b || name == "proto_weight",
                "{backbone}: `{name}` did not move in training"
            );
        }
        for extra in [
            &["--checkpointing", "blocks"][..],
            &["--checkpointing", "full"],
            &["--checkpointing", "every:2"],
            &["--checkpointing", "full-host"],
            &["--checkpointing", "full", "--fused-backward"],
        ] {
            let mut args = base.to_vec();
            args.extend_from_slice(extra);
            let (_, got) = trained_weights(&args)?;
            assert_eq!(got.len(), plain.len());
            for ((name, a), (_, b)) in plain.iter().zip(&got) {
                assert!(
                    a == b,
                    "{backbone} {extra:?}: `{name}` differs from plain backprop's"
                );
            }
        }
    }
    Ok(())
}

/// A `--model` folder without weights names the file it looked for.
#[test]
fn a_model_without_weights_is_refused() {
    let empty = tmp("empty-model");
    std::fs::create_dir_all(&empty).ok();
    let e = setup(&demo(
        &tmp("no-weights"),
        &["--model", &empty.display().to_string()],
    ))
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn accumulating_episodes_equals_one_big_step() -> anyhow::Result<()> {
    let out = tmp("accum");
    let s = setup(&demo(&out, &["--method", "fsct_softmax"]))?;
    let params: Vec<Var> = s.optimizer.params().to_vec();
    let shape = EpisodeShape {
        n_way: 5,
        k_shot: 1,
        n_query: 6,
    };
    let img = ImageConfig {
        size: 28,
        augment: false,
    };
    let eps: Vec<_> = (0..2)
        .map(|i| sample_episode(&s.task.splits.train, shape, 1, i, img, &Device::Cpu))
        .collect::<Result<_, _>>()?;
    // Evaluation-mode batch norm: the two paths then see the same statistics.
    let queries: Vec<usize> = eps.iter().map(|e| e.n_way * e.n_query).collect();
    let norm = LossNorm::samples(&queries);
    let mut acc = GradAccumulator::new();
    for e in &eps {
        let (l, _) = s
            .task
            .model
            .summed_loss(e, false, &Checkpointer::default())?;
        let g = norm.scale(&l)?.backward()?;
        acc.add(
            params
                .iter()
                .map(|p| g.get(p.as_tensor()).cloned())
                .collect(),
        )?;
    }
    let mut total = None;
    for e in &eps {
        let (l, _) = s
            .task
            .model
            .summed_loss(e, false, &Checkpointer::default())?;
        total = Some(match total {
            Some(t) => (t + l)?,
            None => l,
        });
    }
    let big = (total.expect("loss") / queries.iter().sum::<usize>() as f64)?.backward()?;
    for (p, a) in params.iter().zip(acc.take()) {
        let (Some(a), Some(b)) = (a, big.get(p.as_tensor())) else {
            continue;
        };
        let d = (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?;
        let m = b
            .to_dtype(DType::F64)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?;
        assert!(
            d <= 1e-5 * m.max(1e-8),
            "accumulated gradient differs by {d} (scale {m})"
        );
    }
    Ok(())
}

fn png(path: &Path, seed: u8) {
    let img = image::RgbImage::from_fn(40, 30, |x, y| {
        image::Rgb([(x as u8).wrapping_mul(seed), y as u8, seed])
    });
    img.save(path).expect("png");
}

#[test]
fn datasets_load_and_bad_data_names_the_file_or_class() -> anyhow::Result<()> {
    // One folder of class folders, split by seed into disjoint train/val/test classes.
    let root = tmp("data");
    for c in 0..10 {
        let d = root.join(format!("class{c}"));
        std::fs::create_dir_all(&d)?;
        for i in 0..4 {
            png(&d.join(format!("{i}.png")), (c * 10 + i) as u8);
        }
    }
    let sizes = |s: &Splits| {
        (
            s.train.classes.len(),
            s.val.classes.len(),
            s.test.classes.len(),
        )
    };
    let plan = |n_way, validate| SplitPlan { n_way, validate };
    // Ten classes, 2-way: every split at least an episode wide (the 64/16/20 split gave one
    // validation class), and the split made is said.
    let splits = Splits::from_dir(&root, 0, plan(2, true))?;
    assert_eq!(sizes(&splits), (6, 2, 2));
    splits.check(2, 3)?;
    assert!(splits
        .note
        .as_deref()
        .is_some_and(|n| n.contains("6 train")));
    // 5-way cannot make three disjoint splits of ten classes: the error says what would.
    let e = Splits::from_dir(&root, 0, plan(5, true))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("10 class folders") && e.contains("--val-episodes 0"),
        "{e}"
    );
    // Without validation it can: five to train, five to test.
    let splits = Splits::from_dir(&root, 0, plan(5, false))?;
    assert_eq!(sizes(&splits), (5, 0, 5));
    splits.check(5, 3)?;
    let shape = EpisodeShape {
        n_way: 3,
        k_shot: 1,
        n_query: 2,
    };
    let ep = sample_episode(
        &splits.train,
        shape,
        0,
        0,
        ImageConfig {
            size: 16,
            augment: true,
        },
        &Device::Cpu,
    )?;
    assert_eq!(ep.images.dims(), &[9, 3, 16, 16]);

    // miniImageNet layout: split CSVs and images/.
    let mini = tmp("mini");
    std::fs::create_dir_all(mini.join("images"))?;
    let mut rows = std::collections::HashMap::new();
    for (split, classes) in [
        ("train", ["n01", "n02"]),
        ("val", ["n03", "n04"]),
        ("test", ["n05", "n06"]),
    ] {
        let mut text = String::from("filename,label\n");
        for c in classes {
            for i in 0..3 {
                let f = format!("{c}_{i}.png");
                png(&mini.join("images").join(&f), i as u8 + 1);
                text.push_str(&format!("{f},{c}\n"));
            }
        }
        rows.insert(split, text.clone());
        std::fs::write(mini.join(format!("{split}.csv")), text)?;
    }
    let m = Splits::from_dir(&mini, 0, plan(2, true))?;
    m.check(2, 3)?;
    assert_eq!(m.test.classes[1].name, "n06");
    assert!(m.note.is_none(), "the data gave every split");

    // A missing image and a corrupt one name the file.
    std::fs::remove_file(mini.join("images").join("n01_0.png"))?;
    let shape = EpisodeShape {
        n_way: 2,
        k_shot: 1,
        n_query: 2,
    };
    let img = ImageConfig {
        size: 16,
        augment: false,
    };
    let err = (0..20)
        .find_map(|i| sample_episode(&m.train, shape, 0, i, img, &Device::Cpu).err())
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("n01_0.png"), "{err}");
    std::fs::write(mini.join("images").join("n01_0.png"), b"not a png")?;
    let err = (0..20)
        .find_map(|i| sample_episode(&m.train, shape, 0, i, img, &Device::Cpu).err())
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("n01_0.png") && err.contains("cannot read image"),
        "{err}"
    );

    // A malformed CSV line names file and line; too few images names the class.
    std::fs::write(mini.join("val.csv"), "filename,label\nonly_one_field\n")?;
    let e = Splits::from_dir(&mini, 0, plan(2, true))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("val.csv:2"), "{e}");
    // Without val.csv, validation classes are carved from the training ones (and said), or
    // there is no validation at all.
    std::fs::remove_file(mini.join("val.csv"))?;
    let e = Splits::from_dir(&mini, 0, plan(2, true))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("no val.csv") && e.contains("--val-episodes 0"),
        "{e}"
    );
    let m = Splits::from_dir(&mini, 0, plan(2, false))?;
    assert_eq!(sizes(&m), (2, 0, 2));
    m.check(2, 3)?;
    let e = Splits::synthetic(30, 4, 0)
        .check(5, 6)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("synthetic-000") && e.contains("4 images"), "{e}");
    Ok(())
}

/// `--plan` counts, from shapes alone, the trainable parameters the run builds, and places the
/// state as the flags say.
#[test]
fn plan_counts_what_the_run_builds() -> anyhow::Result<()> {
    let out = tmp("plan");
    let args = demo(&out, &["--plan"]);
    let plan = fewshot_ft::run::plan(&args)?;
    let s = setup(&demo(&out, &[]))?;
    let (n, _) = s.task.store.count(true);
    assert_eq!(plan.params, n as u64);
    // The demo trains in f32 on the CPU, one episode a step: weights, gradients and moments,
    // no masters, no separate sums.
    assert_eq!(args.common.accum, 1);
    assert_eq!(plan.state_device_bytes(), (4 + 4 + 8) * n as u64);
    let accumulated = fewshot_ft::run::plan(&demo(&out, &["--plan", "--accum", "4"]))?;
    assert_eq!(accumulated.state_device_bytes(), (4 + 4 + 4 + 8) * n as u64);
    assert_eq!(plan.host_bytes(), 0);
    // One episode's activations (the formulas are checked against the graph in ft-models'
    // tests): recomputing keeps less from forward to backward, and full-host less still on
    // the device.
    let held = |strategy: &str| -> anyhow::Result<_> {
        let p = fewshot_ft::run::plan(&demo(&out, &["--plan", "--checkpointing", strategy]))?;
        p.activations()
            .ok_or_else(|| anyhow::anyhow!("no activation rows"))
    };
    let (none, blocks, full, host) = (
        held("none")?,
        held("blocks")?,
        held("full")?,
        held("full-host")?,
    );
    assert!(
        full.kept < none.kept && none.kept < blocks.kept,
        "{full:?} {none:?} {blocks:?}"
    );
    assert!(host.kept < full.kept && host.host > 0 && full.recompute > 0);
    assert_eq!(plan.activation_device_bytes(), none.peak());
    Ok(())
}
