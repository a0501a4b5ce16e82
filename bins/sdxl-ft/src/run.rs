//! From arguments to a finished run: open the pipeline, build or reuse the cache (the encoders
//! live only inside it), load the UNet once in the training dtype, train on the shared loop.

use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use candle_core::{DType, Device};
use ft_models::activations::{Target, UNetShape};
use ft_models::diffusion::Prediction;
use ft_models::unet::UNet;
use ft_params::bytes::format_bytes;
use ft_params::ParamStore;
use ft_trainer::ledger::{Category, Ledger};
use ft_trainer::train::ema::Ema;
use ft_trainer::train::plan::StatePlan;
use ft_trainer::train::{ranks, Binary, LoopPlan, ModelRepo, RunSummary, SessionBuilder, Units};
use ft_trainer::update::{MixedOptimizer, Precision};

use crate::cache::{Cache, CacheSettings};
use crate::cli::Args;
use crate::data::{Crop, ImageFolder};
use crate::mmd::{ClipSource, MmdEval};
use crate::pipeline::Pipeline;
use crate::task::{EvalSettings, Objective, SdxlTask};

/// Everything a run needs, built from the arguments (also used by tests and benches).
pub type Setup = ft_trainer::train::Session<SdxlTask>;

/// The arguments validated, the output folder created and, with `--demo`, the bundled pipeline
/// and images written there and pointed to.
fn resolved(args: &Args) -> Result<Args> {
    let mut args = args.clone();
    args.validate()?;
    let out = args.common.create_output_dir()?;
    if args.common.demo {
        // Rank 0 writes the demo; the other ranks of a data-parallel run read it.
        let dir = out.join("demo-data");
        ranks::main_first(|| crate::demo::write(&dir, 48, args.common.seed))?;
        let demo = crate::demo::at(&dir);
        args.common.model = Some(demo.model.display().to_string());
        // The demo's held-out shapes are the real set for the demo's images only.
        if args.data_dir.is_none() && args.eval_mmd_samples > 0 {
            args.eval_data_dir.get_or_insert(demo.held_out);
        }
        args.data_dir.get_or_insert(demo.data);
    }
    Ok(args)
}

/// `--plan`: the memory plan of the UNet's training from `unet/config.json` alone (built from
/// shapes, no weights read, nothing allocated, no device opened), with the EMA when `--ema`.
pub fn plan(args: &Args) -> Result<StatePlan> {
    let args = resolved(args)?;
    let pipeline = open_pipeline(&args)?;
    let (pb, store, precision) = args.common.shapes_builder()?;
    let unet = UNet::new(&pb, &pipeline.unet)?;
    unet_plan(&args, &store, &unet, precision, pipeline.vae_factor())
}

/// Tokens of the text states the UNet attends to: SDXL's tokenizers pad to 77.
const CONTEXT_TOKENS: usize = 77;

/// The UNet's model states under these arguments, with the EMA when `--ema`, and the
/// activations of one micro-batch of `--res` images (square: aspect buckets keep about the same
/// area) with the loss. The latents are `--res` over the VAE's `factor` (8 for SDXL's, 4 for the
/// demo's three-level VAE: assuming 8 there planned a quarter of the demo's latent area).
fn unet_plan(
    args: &Args,
    store: &ParamStore,
    unet: &UNet,
    precision: Precision,
    factor: usize,
) -> Result<StatePlan> {
    let plan = args.common.state_plan(store, &unet.segments(), precision)?;
    let side = args.res / factor;
    let shape = UNetShape {
        batch: args.common.batch_size,
        height: side,
        width: side,
        context_len: CONTEXT_TOKENS,
    };
    let dtype = precision.storage;
    let mut profile =
        unet.config()
            .activations(&shape, dtype, Target::of_device(&args.common.device));
    // The loss: the prediction in f32 (when it is not), its difference from the target and
    // the square of that, per latent element.
    let n = (shape.batch * unet.config().out_channels * side * side) as u64;
    profile.outer += 4 * n * (2 + (dtype != DType::F32) as u64);
    let what = format!("UNet and loss, batch {} at {} px", shape.batch, args.res);
    let plan = args.common.with_activations(plan, &what, &profile)?;
    if !args.ema {
        return Ok(plan);
    }
    // Over several ranks each keeps its share of the average (ZeRO's partition).
    let world = args.common.planned_world()?;
    let sizes: Vec<usize> = store
        .shapes(true)
        .iter()
        .map(|s| s.iter().product())
        .collect();
    let share = ft_trainer::update::zero::largest_share(&sizes, world) as u64;
    let label = match world {
        1 => "EMA (fp32)".to_string(),
        w => format!("EMA (fp32): this rank's share ({w} ranks)"),
    };
    Ok(plan.with(&label, 4 * share, args.ema_device == "cpu"))
}

/// Resolves model and data, builds the cache, loads the UNet. With `--demo`, first writes the
/// bundled pipeline and images.
pub fn setup(args: &Args) -> Result<Setup> {
    // The folder is this run's before the demo's files are written into it.
    args.validate()?;
    let lock = ranks::lock_output(&args.common.output_dir)?;
    let args = resolved(args)?;
    let out = args.common.output_dir.clone();
    let mut s = SessionBuilder::with_lock(&args.common, lock)?;
    let (device, precision) = (s.device().clone(), s.precision());

    let pipeline = open_pipeline(&args)?;
    // The CLIP tower's files before the cache is built: a wrong name fails at once.
    let clip = match (&args.eval_clip_model, args.eval_mmd_samples) {
        (Some(spec), n) if n > 0 && ranks::is_main()? => Some(ClipSource::open(spec)?),
        _ => None,
    };
    let schedule = pipeline.schedule.clone();
    let data_dir: PathBuf = args
        .data_dir
        .clone()
        .ok_or_else(|| anyhow!("--data-dir is required"))?;
    let folder = ImageFolder::scan(&data_dir, &args.caption_column)?;
    let prompts = sample_prompts(&args, &folder);
    let settings = cache_settings(&args, &pipeline, precision, &device)?;
    let cache_root = args.cache_dir.clone().unwrap_or_else(|| out.join("cache"));
    let cache = Cache::build_or_reuse(
        &cache_root,
        &pipeline,
        &folder,
        &prompts,
        &settings,
        s.ledger(),
    )?;
    report_cache(&cache);
    // The held-out set before the UNet: its encoders and CLIP pass never sit beside training.
    let mmd = mmd_eval(&args, &pipeline, &settings, &cache, clip, s.ledger())?;

    // The UNet: from the checkpoint being resumed, else the pipeline's weights.
    let files = match s.resumed_weights("unet/diffusion_pytorch_model")? {
        Some(files) => files,
        None => pipeline.weights("unet", "diffusion_pytorch_model")?,
    };
    let unet = UNet::new(&s.params(Some(files)), &pipeline.unet)?;
    s.loaded()?;
    let store = s.store().clone();
    let optimizer = s.optimizer(&unet_plan(
        &args,
        &store,
        &unet,
        precision,
        pipeline.vae_factor(),
    )?)?;
    let ema = ema(&args, &optimizer, &device)?;
    if let Some(ema) = &ema {
        s.ledger()
            .set_on(Category::Ema, "unet", ema.bytes(), ema.device());
    }
    let dtype = precision.storage;
    let mut task = SdxlTask::new(
        unet,
        store,
        pipeline,
        cache,
        schedule,
        Objective {
            caption_dropout: args.caption_dropout,
            snr_gamma: args.snr_gamma,
            noise_offset: args.noise_offset,
            flip: args.random_flip,
        },
        EvalSettings {
            loss_images: args.eval_images,
            sampler: args.sampler.parse()?,
            steps: args.sample_steps,
            guidance_scale: args.guidance_scale,
            vae_decode_chunk: args.vae_decode_chunk,
            vae_tile: args.vae_tile,
            dir: out.join("samples"),
        },
        ema,
        device,
        dtype,
        args.common.batch_size,
        args.common.seed,
    );
    task.mmd = mmd;
    let batches = task.batches_per_epoch();
    Ok(s.session(task, optimizer, LoopPlan::new(Units::Samples, batches))?)
}

/// With `--eval-mmd-samples N`, the held-out set: the first N images of `--eval-data-dir`
/// (cached like the training images, without flips) or else of the training cache, and their
/// features (`clip`'s, else pooled latents).
fn mmd_eval(
    args: &Args,
    pipeline: &Pipeline,
    settings: &CacheSettings,
    train: &Cache,
    clip: Option<ClipSource>,
    ledger: &mut Ledger,
) -> Result<Option<MmdEval>> {
    let n = args.eval_mmd_samples;
    // Rank 0 alone evaluates.
    if n == 0 || !ranks::is_main()? {
        return Ok(None);
    }
    let cache = match &args.eval_data_dir {
        Some(dir) => {
            let flag = || format!("--eval-data-dir {}", dir.display());
            let mut folder = ImageFolder::scan(dir, &args.caption_column).with_context(flag)?;
            folder.records.truncate(n);
            let root = args
                .cache_dir
                .clone()
                .unwrap_or_else(|| args.common.output_dir.join("cache"));
            let settings = CacheSettings {
                flip: false,
                crop: Crop::Center,
                ..settings.clone()
            };
            Cache::build_or_reuse(&root, pipeline, &folder, &[], &settings, ledger)
                .with_context(flag)?
        }
        None => {
            ranks::say(format!(
                "--eval-mmd-samples without --eval-data-dir: the real set is the first {n} training images, not held out\n"
            ));
            Cache::open(&train.dir, false)?
        }
    };
    if cache.len() < n {
        ranks::say(format!(
            "--eval-mmd-samples {n}: {} of the first {n} images are readable; comparing {} samples\n",
            cache.len(),
            cache.len()
        ));
    }
    let mmd = MmdEval::new(
        cache,
        n,
        clip,
        pipeline.vae.scaling_factor,
        &settings.device,
        settings.dtype,
    )?;
    ranks::say(format!(
        "MMD: {n} generated samples against {n} real images, {f} features (kid_{f}, cmmd_{f})\n",
        n = mmd.n,
        f = mmd.features()
    ));
    Ok(Some(mmd))
}

/// The diffusers pipeline `--model` (or the default) names, with `--variant`, its scheduler's
/// prediction type replaced by `--prediction-type`.
fn open_pipeline(args: &Args) -> Result<Pipeline> {
    let mut pipeline = Pipeline::open(args.model().unwrap_or_default(), args.variant.clone())?;
    if let Some(p) = &args.prediction_type {
        pipeline.schedule.prediction = match p.as_str() {
            "epsilon" => Prediction::Epsilon,
            "v_prediction" => Prediction::VPrediction,
            other => {
                return Err(anyhow!(
                    "--prediction-type `{other}`: expected epsilon or v_prediction"
                ))
            }
        };
    }
    Ok(pipeline)
}

/// The prompts of the evaluation samples: `--sample-prompt`, else the first `--num-samples`
/// distinct captions of the data.
fn sample_prompts(args: &Args, folder: &ImageFolder) -> Vec<String> {
    if !args.sample_prompt.is_empty() {
        return args.sample_prompt.clone();
    }
    let mut seen = Vec::new();
    for r in &folder.records {
        if seen.len() >= args.num_samples {
            break;
        }
        if !seen.contains(&r.caption) {
            seen.push(r.caption.clone());
        }
    }
    seen
}

/// What the latent and embedding cache is built with: resolution and aspect buckets (checked
/// against the VAE and UNet's downsampling), crop, flips, and the encoders' dtype.
fn cache_settings(
    args: &Args,
    pipeline: &Pipeline,
    precision: Precision,
    device: &Device,
) -> Result<CacheSettings> {
    // The encoders run in the training dtype, except f16, where SDXL's VAE overflows.
    let encoder_dtype = match precision.storage {
        DType::F16 => DType::F32,
        d => d,
    };
    // Latent sides must halve cleanly through the UNet's levels.
    let multiple = pipeline.vae_factor() * pipeline.unet_factor();
    if !args.res.is_multiple_of(multiple) {
        return Err(anyhow!(
            "--res {} must be a multiple of {multiple} for this model (VAE factor {} x UNet factor {})",
            args.res,
            pipeline.vae_factor(),
            pipeline.unet_factor()
        ));
    }
    let buckets = args.aspect_buckets.then(|| {
        let step = args
            .bucket_step
            .unwrap_or(if args.res >= 512 { 64 } else { 8 })
            .div_ceil(multiple)
            * multiple;
        crate::data::buckets(args.res, step)
    });
    Ok(CacheSettings {
        res: args.res,
        buckets,
        crop: if args.crop == "random" {
            Crop::Random
        } else {
            Crop::Center
        },
        flip: args.random_flip,
        seed: args.common.seed,
        strict_images: args.strict_images,
        device: device.clone(),
        dtype: encoder_dtype,
    })
}

/// With `--ema`, the average of the optimizer's weights (its fp32 masters where it has them) on
/// the host or the device, restored from the checkpoint being resumed: this rank's share of it
/// in a data-parallel run (rank 0 takes the others' to evaluate and save).
fn ema(args: &Args, optimizer: &MixedOptimizer, device: &Device) -> Result<Option<Ema>> {
    if !args.ema {
        return Ok(None);
    }
    let ema_device = if args.ema_device == "cpu" {
        Device::Cpu
    } else {
        device.clone()
    };
    let sizes: Vec<usize> = optimizer.params().iter().map(|p| p.elem_count()).collect();
    let mut ema = Ema::sharded(
        optimizer.names(),
        optimizer.weights(),
        &sizes,
        args.ema_decay,
        args.ema_every,
        &ema_device,
        ranks::world()?,
    )?;
    if let Some(dir) = &args.common.resume {
        let saved =
            ModelRepo::Local(dir.clone()).safetensors("unet_ema/diffusion_pytorch_model")?;
        ema.load(|name, shape| {
            Ok(saved.load(name, Some(shape), DType::F32, &Device::Cpu, false)?)
        })?;
    }
    Ok(Some(ema))
}

fn report_cache(cache: &Cache) {
    let m = &cache.manifest;
    eprintln!(
        "cache {} ({}): {} images, {} captions, {}",
        if cache.built { "built" } else { "reused" },
        cache.dir.display(),
        m.entries.len(),
        m.captions.len(),
        format_bytes(cache.disk_bytes() as i64)
    );
    if let Some((file, reason)) = m.skipped.first() {
        // The reason names the file already where it comes from the image decoder.
        let first = if reason.contains(file.as_str()) {
            reason.clone()
        } else {
            format!("{file}: {reason}")
        };
        eprintln!(
            "skipped {} unreadable images (first: {first}); --strict-images stops instead",
            m.skipped.len()
        );
    }
}

/// Trains as the arguments say and prints the memory table.
pub fn run(args: &Args) -> Result<RunSummary> {
    let mut s = setup(args)?;
    let (n, bytes) = s.task.store.count(true);
    // Rank 0 reports for a data-parallel run.
    let main = ranks::is_main()?;
    if main {
        eprintln!(
        "sdxl-ft: UNet with {n} trainable parameters ({}), {} steps of {} x {} images, {:?}, checkpointing {}",
        format_bytes(bytes as i64),
        s.loop_config.max_steps,
        s.loop_config.mode.micro_batches(),
        s.task.batch_size,
        s.task.dtype,
        s.checkpointer.strategy()
    );
    }
    let summary = s.train()?;
    if !main {
        return Ok(summary);
    }
    eprintln!("{}", s.ledger.table());
    if let Some(dir) = &summary.final_dir {
        eprintln!(
            "UNet saved in {} (diffusers layout){}; samples in {}",
            dir.join("unet").display(),
            if s.task.ema.is_some() {
                ", EMA in unet_ema/"
            } else {
                ""
            },
            s.task.eval.dir.display()
        );
    }
    Ok(summary)
}
