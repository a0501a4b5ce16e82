//! Evaluation holds one segment's graph at a time (`Checkpointer::inference`): its heap peak
//! (the counting allocator: exact bytes) against a plain forward's, which keeps every segment's
//! graph until its result is dropped (the weights are variables), for T5's evaluation loss, a
//! few-shot model's evaluation and the UNet's forward as sdxl-ft's sampling runs it. Fails if evaluation goes back to a plain forward. One test,
//! so that no other test's allocations share the process's peak.

use candle_core::{DType, Device, Tensor};
use ft_models::dropout::DropoutCtx;
use ft_models::fewshot::{Backbone, BackboneKind, Episode, FewShotModel, Method};
use ft_models::t5::{T5Batch, T5Config, T5};
use ft_models::unet::{UNet, UNetConfig};
use ft_params::checkpoint::Checkpointer;
use ft_params::{ParamBuilder, ParamStore};
use ft_trainer::ledger::alloc;

#[global_allocator]
static ALLOC: alloc::CountingAlloc = alloc::CountingAlloc;

/// The heap's peak above its level before `f`, with `f`'s result held to the end (as a caller
/// holds a loss until it has read it).
fn peak<T>(f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<u64> {
    let base = alloc::live_bytes();
    alloc::reset_peak();
    let kept = f()?;
    let p = alloc::peak_bytes().saturating_sub(base) as u64;
    drop(kept);
    Ok(p)
}

#[test]
fn evaluation_holds_a_fraction_of_the_plain_forward() -> anyhow::Result<()> {
    ft_trainer::ledger::measure::warm_matmul_scratch();
    let dev = Device::Cpu;

    let mut cfg = T5Config::tiny(64);
    (cfg.d_model, cfg.d_ff, cfg.num_layers) = (64, 128, 4);
    cfg.num_decoder_layers = Some(4);
    let pb = ParamBuilder::new(ParamStore::new(), DType::F32, &dev, 2);
    let t5 = T5::new(&pb, &cfg)?;
    let (b, ls, lt) = (8, 64, 16);
    let batch = T5Batch {
        input_ids: Tensor::from_vec(
            (0..b * ls).map(|i| 2 + i as u32 % 60).collect(),
            (b, ls),
            &dev,
        )?,
        attention_mask: Tensor::ones((b, ls), DType::F32, &dev)?,
        labels: Tensor::from_vec(
            (0..b * lt).map(|i| 2 + i as i64 % 7).collect(),
            (b, lt),
            &dev,
        )?,
        label_tokens: b * lt,
    };
    let plain =
        peak(|| Ok(t5.summed_loss(&batch, &DropoutCtx::eval(), &Checkpointer::new(false))?))?;
    let eval = peak(|| Ok(t5.eval_summed_loss(&batch)?))?;
    println!("t5: plain forward {plain} B, evaluation {eval} B");
    assert!(
        eval * 2 < plain,
        "t5: evaluation {eval} B against a plain forward's {plain} B"
    );

    let pb = ParamBuilder::new(ParamStore::new(), DType::F32, &dev, 3);
    let m = FewShotModel::new(
        &pb,
        Backbone::new(&pb, BackboneKind::Conv4, 40, true)?,
        Method::FsctCosine,
        5,
        1,
    )?;
    let ep = Episode {
        images: Tensor::randn(0f32, 1., (35, 3, 40, 40), &dev)?,
        n_way: 5,
        k_shot: 1,
        n_query: 6,
    };
    let plain = peak(|| Ok(m.summed_loss(&ep, false, &Checkpointer::new(false))?))?;
    let eval = peak(|| Ok(m.evaluate(&ep)?))?;
    println!("fewshot: plain forward {plain} B, evaluation {eval} B");
    assert!(
        eval * 2 < plain,
        "fewshot: evaluation {eval} B against a plain forward's {plain} B"
    );

    // The tiny UNet fixture at 32 x 32 latents: the segments and what runs between them
    // (`Checkpointer::cut`).
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/unet_tiny/config.json");
    let cfg = UNetConfig::from_file(&path)?;
    let pb = ParamBuilder::new(ParamStore::new(), DType::F32, &dev, 1);
    let unet = UNet::new(&pb, &cfg)?;
    let te_dim = cfg.projection_class_embeddings_input_dim.unwrap_or(0) - 48;
    let x = Tensor::randn(0f32, 1., (2, 4, 32, 32), &dev)?;
    let ctx = Tensor::randn(0f32, 1., (2, 7, cfg.cross_attention_dim), &dev)?;
    let te = Tensor::randn(0f32, 1., (2, te_dim), &dev)?;
    let ids = Tensor::ones((2, 6), DType::F32, &dev)?;
    let run = |ck: &Checkpointer| unet.forward(&x, &[10.0, 10.0], &ctx, Some((&te, &ids)), ck);
    let plain = peak(|| Ok(run(&Checkpointer::new(false))?))?;
    let eval = peak(|| Ok(run(&Checkpointer::inference())?))?;
    println!("unet: plain forward {plain} B, inference {eval} B");
    assert!(
        eval * 2 < plain,
        "unet: inference {eval} B against a plain forward's {plain} B"
    );
    Ok(())
}
