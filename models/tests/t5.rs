//! The T5 model: every trainable parameter gets a nonzero gradient, checkpointed blocks give the
//! gradients of plain backprop, dropout masks repeat under recompute, buckets match transformers.

use candle_core::{DType, Device, Tensor, Var};
use ft_models::dropout::DropoutCtx;
use ft_models::t5::{
    relative_position_bucket, shift_right, summed_cross_entropy, T5Batch, T5Config, T5,
};
use ft_params::checkpoint::{Checkpointer, Strategy};
use ft_params::{ParamBuilder, ParamStore};

fn batch(dev: &Device) -> anyhow::Result<T5Batch> {
    let ids = Tensor::new(&[[5u32, 6, 7, 1, 0], [8, 9, 10, 11, 1]], dev)?;
    let mask = Tensor::new(&[[1f32, 1., 1., 1., 0.], [1., 1., 1., 1., 1.]], dev)?;
    let labels = Tensor::new(&[[12i64, 13, 1, -100], [14, 15, 16, 1]], dev)?;
    Ok(T5Batch {
        input_ids: ids,
        attention_mask: mask,
        labels,
        label_tokens: 7,
    })
}

fn model(cfg: &T5Config) -> anyhow::Result<(T5, Vec<(String, Var)>)> {
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &Device::Cpu, 3);
    let m = T5::new(&pb, cfg)?;
    Ok((m, store.trainable()?))
}

fn grads(
    m: &T5,
    params: &[Var],
    ck: &Checkpointer,
    drop: &DropoutCtx,
) -> anyhow::Result<Vec<Tensor>> {
    let b = batch(&Device::Cpu)?;
    let loss = m.summed_loss(&b, drop, ck)?;
    ck.gradients(&loss, params)?
        .into_iter()
        .map(|g| g.ok_or_else(|| anyhow::anyhow!("missing gradient")))
        .collect()
}

#[test]
fn every_parameter_gets_a_nonzero_gradient_in_both_variants() -> anyhow::Result<()> {
    for (ff, tied) in [("gated-gelu", false), ("relu", true)] {
        let mut cfg = T5Config::tiny(20);
        cfg.feed_forward_proj = ff.into();
        cfg.tie_word_embeddings = tied;
        let (m, params) = model(&cfg)?;
        let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
        let gs = grads(&m, &vars, &Checkpointer::new(false), &DropoutCtx::eval())?;
        for ((name, _), g) in params.iter().zip(&gs) {
            let s = g.abs()?.sum_all()?.to_scalar::<f32>()?;
            assert!(s > 0.0, "{ff}: `{name}` has a zero gradient");
        }
        let names: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        assert!(
            names.contains(&"encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        );
        assert!(names.contains(&"decoder.block.1.layer.1.EncDecAttention.q.weight"));
        assert_eq!(names.contains(&"lm_head.weight"), !tied);
        assert_eq!(
            names.contains(&"decoder.block.0.layer.2.DenseReluDense.wi_1.weight"),
            !tied
        );
    }
    Ok(())
}

#[test]
fn the_fused_head_loss_equals_logits_then_cross_entropy() -> anyhow::Result<()> {
    for tied in [false, true] {
        let mut cfg = T5Config::tiny(20);
        cfg.tie_word_embeddings = tied;
        let (m, params) = model(&cfg)?;
        let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
        let (ck, drop) = (Checkpointer::new(false), DropoutCtx::eval());
        let b = batch(&Device::Cpu)?;
        let fused = m.summed_loss(&b, &drop, &ck)?;
        let plain = summed_cross_entropy(&m.forward(&b, &drop, &ck)?, &b.labels)?;
        let (f, p) = (fused.to_scalar::<f32>()?, plain.to_scalar::<f32>()?);
        assert!((f - p).abs() <= 1e-5 * p.abs(), "tied {tied}: {f} vs {p}");
        let eval = m.eval_summed_loss(&b)?;
        assert!(!eval.track_op());
        assert_eq!(eval.to_scalar::<f32>()?, f);
        let gf = ck.gradients(&fused, &vars)?;
        let gp = ck.gradients(&plain, &vars)?;
        for (((name, _), a), b) in params.iter().zip(&gf).zip(&gp) {
            let (a, b) = (a.as_ref().expect("grad"), b.as_ref().expect("grad"));
            let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-12);
            let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                diff <= 1e-5 * scale,
                "tied {tied}: `{name}` differs by {diff}"
            );
        }
    }
    Ok(())
}

#[test]
fn checkpointed_blocks_with_dropout_equal_plain_backprop() -> anyhow::Result<()> {
    let mut cfg = T5Config::tiny(20);
    cfg.dropout_rate = 0.2;
    let (m, params) = model(&cfg)?;
    let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
    let drop = DropoutCtx::train(0.2, 77);
    let plain = grads(&m, &vars, &Checkpointer::new(false), &drop)?;
    for strategy in [
        Strategy::Blocks,
        Strategy::Full,
        Strategy::FullHost,
        Strategy::Every(2),
    ] {
        let ckpt = grads(&m, &vars, &Checkpointer::with_strategy(strategy), &drop)?;
        for ((name, _), (a, b)) in params.iter().zip(plain.iter().zip(&ckpt)) {
            let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let s = a.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-12);
            // Not bit for bit: the encoder's output (read by every decoder segment), the
            // relative bias (shared by a stack's layers) and the embedding sum their
            // contributions in another order than plain backprop, and the difference flows on.
            assert!(
                d / s < 1e-5,
                "{strategy}: `{name}` differs by {d} (scale {s})"
            );
        }
    }
    // Another dropout seed gives another loss: dropout is really on.
    let b = batch(&Device::Cpu)?;
    let ck = Checkpointer::new(false);
    let l1 = m.summed_loss(&b, &drop, &ck)?.to_scalar::<f32>()?;
    let l2 = m
        .summed_loss(&b, &DropoutCtx::train(0.2, 78), &ck)?
        .to_scalar::<f32>()?;
    assert_ne!(l1, l2);
    Ok(())
}

#[test]
fn relative_buckets_match_transformers_values() {
    // Values from transformers' T5Attention._relative_position_bucket (32 buckets, max 128).
    let bi = [
        (-200, 15),
        (-20, 10),
        (-8, 8),
        (-7, 7),
        (0, 0),
        (1, 17),
        (7, 23),
        (8, 24),
        (50, 29),
        (300, 31),
    ];
    for (rp, want) in bi {
        assert_eq!(
            relative_position_bucket(rp, true, 32, 128),
            want,
            "bidirectional {rp}"
        );
    }
    let causal = [
        (5, 0),
        (0, 0),
        (-1, 1),
        (-15, 15),
        (-16, 16),
        (-40, 23),
        (-127, 31),
        (-500, 31),
    ];
    for (rp, want) in causal {
        assert_eq!(
            relative_position_bucket(rp, false, 32, 128),
            want,
            "causal {rp}"
        );
    }
}

#[test]
fn shift_right_starts_with_the_decoder_start_and_drops_ignore_labels() {
    let out = shift_right(&[vec![5, 6, 1, -100]], 0, 0);
    assert_eq!(out, vec![vec![0, 5, 6, 1]]);
}

#[test]
fn bad_config_is_rejected_with_the_file_name() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("t5cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let p = dir.join("config.json");
    std::fs::write(&p, r#"{"d_model": 0, "feed_forward_proj": "gated-gelu"}"#)?;
    let e = T5Config::from_file(&p).unwrap_err().to_string();
    assert!(e.contains("config.json") && e.contains("d_model"), "{e}");
    std::fs::write(&p, r#"{"feed_forward_proj": "gated-mish"}"#)?;
    let e = T5Config::from_file(&p).unwrap_err().to_string();
    assert!(e.contains("mish"), "{e}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn padding_does_not_change_an_examples_logits() -> anyhow::Result<()> {
    let (m, _) = model(&T5Config::tiny(20))?;
    let dev = Device::Cpu;
    let ck = Checkpointer::new(false);
    let alone = T5Batch {
        input_ids: Tensor::new(&[[5u32, 6, 1]], &dev)?,
        attention_mask: Tensor::new(&[[1f32, 1., 1.]], &dev)?,
        labels: Tensor::new(&[[7i64, 1]], &dev)?,
        label_tokens: 2,
    };
    let padded = T5Batch {
        input_ids: Tensor::new(&[[5u32, 6, 1, 0, 0], [9, 9, 9, 9, 1]], &dev)?,
        attention_mask: Tensor::new(&[[1f32, 1., 1., 0., 0.], [1., 1., 1., 1., 1.]], &dev)?,
        labels: Tensor::new(&[[7i64, 1, -100], [8, 8, 1]], &dev)?,
        label_tokens: 5,
    };
    let a = m.forward(&alone, &DropoutCtx::eval(), &ck)?;
    let p = m
        .forward(&padded, &DropoutCtx::eval(), &ck)?
        .narrow(0, 0, 1)?
        .narrow(1, 0, 2)?;
    let d = (a - p)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(d < 1e-5, "padding changed the logits by {d}");
    Ok(())
}

#[test]
fn param_shapes_list_exactly_what_the_model_creates() -> anyhow::Result<()> {
    for (ff, tied) in [("gated-gelu", false), ("relu", true)] {
        let mut cfg = T5Config::tiny(20);
        cfg.feed_forward_proj = ff.into();
        cfg.tie_word_embeddings = tied;
        let (_, params) = model(&cfg)?;
        let mut built: Vec<(String, Vec<usize>)> = params
            .iter()
            .map(|(n, v)| (n.clone(), v.dims().to_vec()))
            .collect();
        let mut listed = cfg.param_shapes();
        built.sort();
        listed.sort();
        assert_eq!(built, listed);
    }
    // google/flan-t5-xl's config: 2.85B parameters.
    let xl: T5Config = serde_json::from_str(
        r#"{"d_ff": 5120, "d_kv": 64, "d_model": 2048, "num_heads": 32, "num_layers": 24,
            "feed_forward_proj": "gated-gelu", "tie_word_embeddings": false, "vocab_size": 32128}"#,
    )?;
    assert_eq!(xl.param_count(), 2_849_757_184);
    Ok(())
}
