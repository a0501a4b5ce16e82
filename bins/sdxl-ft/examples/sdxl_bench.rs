//! `cargo run -p sdxl-ft --example sdxl_bench` : train-step time and peak memory of a mid-size
//! SDXL-shaped UNet on CPU at 128 and 256 px, with and without checkpointing, next to PyTorch +
//! diffusers in the same run (when `python3` with torch and diffusers is found; set `BENCH_PYTHON`
//! to choose one), then the memory plan of the full SDXL UNet from its real config.
//! `SDXL_BENCH_ONLY="256 full"` runs one row (pixels and `--checkpointing`), for a profiler.

use candle_core::{DType, Device, Tensor, Var};
use ft_models::unet::{UNet, UNetConfig};
use ft_params::bytes::format_bytes;
use ft_params::checkpoint::{Checkpointer, Strategy};
use ft_params::rng::SplitMix64;
use ft_params::{ParamBuilder, ParamStore};
use ft_trainer::train::bench::{
    bytes_or_dash, kept_line, measure_steps, python_reference, StepMeasure,
};

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

const STEPS: usize = 3;
const POOLED: usize = 64;

/// SDXL's block layout at a fifth of its width: three levels, transformer depth 1/1/2 on the
/// cross-attention levels, 64-dim heads, linear projections, text_time conditioning.
fn mid_config() -> serde_json::Value {
    serde_json::json!({
        "_class_name": "UNet2DConditionModel", "act_fn": "silu",
        "addition_embed_type": "text_time", "addition_time_embed_dim": 32,
        "attention_head_dim": [1, 2, 4], "block_out_channels": [64, 128, 256],
        "cross_attention_dim": 256,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "in_channels": 4, "out_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
        "norm_eps": 1e-5, "projection_class_embeddings_input_dim": POOLED + 6 * 32,
        "transformer_layers_per_block": [1, 1, 2], "use_linear_projection": true,
        "sample_size": 16,
    })
}

/// Elementwise activation volume of one forward pass relative to the latent area: each level's
/// channels times its spatial share, counted once per ResNet and once per transformer layer on
/// the down, mid and up paths. The ratio of two configs scales a measured activation peak.
fn activation_proxy(cfg: &UNetConfig) -> f64 {
    let n = cfg.block_out_channels.len();
    let lpb = cfg.layers_per_block as f64;
    let t = |i: usize| -> f64 {
        match &cfg.transformer_layers_per_block {
            Some(ft_models::unet::PerLevel::One(v)) => *v as f64,
            Some(ft_models::unet::PerLevel::Each(v)) => v.get(i).copied().unwrap_or(1) as f64,
            None => 1.0,
        }
    };
    let mut sum = 0.0;
    for (i, &c) in cfg.block_out_channels.iter().enumerate() {
        let area = 0.25f64.powi(i as i32);
        let down_attn = cfg.down_block_types[i].starts_with("CrossAttn") as u8 as f64;
        let up_attn = cfg.up_block_types[n - 1 - i].starts_with("CrossAttn") as u8 as f64;
        let blocks = lpb + (lpb + 1.0) + t(i) * (down_attn * lpb + up_attn * (lpb + 1.0));
        sum += c as f64 * area * blocks;
    }
    let top = cfg.block_out_channels[n - 1] as f64 * 0.25f64.powi(n as i32 - 1);
    sum + top * (2.0 + t(n - 1))
}

struct Ours {
    m: StepMeasure,
    param_bytes: u64,
    state_bytes: u64,
    params: usize,
}

fn ours(cfg: &UNetConfig, latent: usize, strategy: Strategy) -> anyhow::Result<Ours> {
    let dev = Device::Cpu;
    let store = ParamStore::new();
    let unet = UNet::new(&ParamBuilder::new(store.clone(), DType::F32, &dev, 0), cfg)?;
    let mut opt = ft_trainer::train::bench::f32_adamw(&store)?;
    let params: Vec<Var> = opt.params().to_vec();
    let mut rng = SplitMix64::new(1);
    let mut randn = |shape: &[usize]| -> anyhow::Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
        Ok(Tensor::from_vec(v, shape, &dev)?)
    };
    let x = randn(&[1, 4, latent, latent])?;
    let target = randn(&[1, 4, latent, latent])?;
    let ctx = randn(&[1, 77, cfg.cross_attention_dim])?;
    let pooled = randn(&[1, POOLED])?;
    let px = (latent * 8) as f32;
    let ids = Tensor::new(&[[px, px, 0.0, 0.0, px, px]], &dev)?;
    let ck = Checkpointer::with_strategy(strategy);
    let mut step = || -> anyhow::Result<()> {
        ck.begin_forward();
        let pred = unet.forward(&x, &[500.0], &ctx, Some((&pooled, &ids)), &ck)?;
        let loss = (pred - &target)?.sqr()?.mean_all()?;
        let grads = ck.gradients(&loss, &params)?;
        drop(loss);
        opt.step(grads, 1e-4)?;
        Ok(())
    };
    let m = measure_steps(STEPS, &mut step)?;
    let (params, param_bytes) = store.count(true);
    Ok(Ours {
        m,
        param_bytes,
        state_bytes: opt.optimizer().state_bytes(),
        params,
    })
}

fn torch(config: &std::path::Path, latent: usize, checkpointing: bool) -> Option<StepMeasure> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/sdxl_bench_torch.py"
    );
    let v = python_reference(
        script,
        &[
            "--config".into(),
            config.display().to_string(),
            "--latent".into(),
            latent.to_string(),
            "--pooled".into(),
            POOLED.to_string(),
            "--steps".into(),
            STEPS.to_string(),
            "--checkpointing".into(),
            if checkpointing { "1" } else { "0" }.into(),
        ],
    )?;
    if let Some(t) = v["torch"].as_str() {
        eprintln!("(PyTorch {t}, {} parameters)", v["params"]);
    }
    Some(StepMeasure {
        step_s: v["step_time_s"].as_f64()?,
        alloc_peak: 0,
        rss_peak: v["rss_peak_above_base_bytes"].as_u64(),
        rss_from_start: v["rss_peak_above_start_bytes"].as_u64(),
        rss_kept: v["rss_kept_by_warm_up_bytes"].as_u64(),
    })
}

fn main() -> anyhow::Result<()> {
    // As the binaries do: candle's per-product thread count read once, not per product, and
    // the work on one of rayon's threads.
    ft_kernels::threads::run(bench)
}

fn bench() -> anyhow::Result<()> {
    let json = mid_config();
    let cfg: UNetConfig = serde_json::from_value(json.clone())?;
    let path = std::env::temp_dir().join(format!("sdxl-bench-{}.json", std::process::id()));
    std::fs::write(&path, json.to_string())?;
    println!(
        "Mid-size SDXL-shaped UNet train step on CPU ({} threads): channels 64/128/256, transformer \
         depth 1/1/2, 64-dim heads, 77 text tokens, batch 1, f32, AdamW; mean of {STEPS} steps after \
         a warm-up\n",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    println!("| run | px | step time | ratio to PyTorch | peak RSS above post-warm-up | peak RSS above start | peak heap above (exact) | params | grads | optimizer |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    // Activation peaks (heap peak minus the gradients) for the plan below.
    let mut act = Vec::new();
    let only = std::env::var("SDXL_BENCH_ONLY").ok();
    for latent in [16usize, 32] {
        // Each strategy of `--checkpointing`; PyTorch plain after `none`, checkpointed after
        // `full`.
        for strategy in [
            Strategy::None,
            Strategy::Blocks,
            Strategy::Every(2),
            Strategy::Full,
        ] {
            if only
                .as_ref()
                .is_some_and(|o| *o != format!("{} {strategy}", latent * 8))
            {
                continue;
            }
            let r = ours(&cfg, latent, strategy)?;
            let torch_ck = match strategy {
                Strategy::None => Some(false),
                Strategy::Full => Some(true),
                _ => None,
            };
            let t = torch_ck.and_then(|ck| torch(&path, latent, ck));
            let reference = match strategy {
                Strategy::None | Strategy::Full => t.as_ref().map(|t| t.step_s),
                _ => None,
            };
            let ratio = reference
                .map(|t| format!("{:.2}x", r.m.step_s / t))
                .unwrap_or("-".into());
            println!(
                "| candle (this repo), --checkpointing {strategy} | {} | {:.3} s | {ratio} | {} | {} | {} | {} | {} | {} |",
                latent * 8,
                r.m.step_s,
                bytes_or_dash(r.m.rss_peak),
                bytes_or_dash(r.m.rss_from_start),
                format_bytes(r.m.alloc_peak as i64),
                format_bytes(r.param_bytes as i64),
                format_bytes(r.param_bytes as i64),
                format_bytes(r.state_bytes as i64)
            );
            if let Some(line) = kept_line(r.m.rss_kept, t.as_ref().and_then(|t| t.rss_kept)) {
                eprintln!("{line}");
            }
            if let Some(t) = t {
                let label = if torch_ck == Some(true) {
                    ", checkpointing"
                } else {
                    ""
                };
                println!(
                    "| PyTorch + diffusers{label} | {} | {:.3} s | 1.00x | {} | {} | - | - | - | - |",
                    latent * 8,
                    t.step_s,
                    bytes_or_dash(t.rss_peak),
                    bytes_or_dash(t.rss_from_start)
                );
            }
            if latent == 16 && strategy == Strategy::None {
                println!("| ({} parameters) | | | | | | | | | |", r.params);
            }
            if let Some(ck) = torch_ck {
                act.push((
                    latent,
                    ck,
                    r.m.alloc_peak.saturating_sub(r.param_bytes) as f64,
                ));
            }
        }
    }
    std::fs::remove_file(&path).ok();
    if only.is_some() {
        return Ok(());
    }

    // The full SDXL UNet from its real config, counted without allocating it.
    let full_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../configs/sdxl/unet_config.json");
    let full = UNetConfig::from_file(&full_path)?;
    let store = ParamStore::new();
    UNet::new(
        &ParamBuilder::new(store.clone(), DType::BF16, &Device::Cpu, 0).shapes_only(),
        &full,
    )?;
    let (n, _) = store.count(true);
    let n = n as u64;
    println!(
        "\nFull SDXL UNet ({n} parameters, configs/sdxl/unet_config.json), bf16 weights, fp32 master \
         weights, AdamW, as sdxl-ft runs it:\n"
    );
    print!("{}", ft_trainer::train::bench::model_states_table(n));
    println!(
        "\n| other | where | bytes |\n|---|---|---|\n| EMA (fp32, --ema-device cpu) | host | {} |",
        format_bytes((4 * n) as i64)
    );
    let scale = activation_proxy(&full) / activation_proxy(&cfg);
    for (px, latent_measured) in [(128usize, 16usize), (1024, 32)] {
        for ck in [false, true] {
            let measured = act
                .iter()
                .find(|a| a.0 == latent_measured && a.1 == ck)
                .map(|a| a.2)
                .unwrap_or(0.0);
            let area = ((px / 8) as f64 / latent_measured as f64).powi(2);
            // Measured in f32, planned in bf16.
            let bytes = measured * scale * area * 0.5;
            println!(
                "| activations at {px} px, batch 1{} (scaled estimate) | device | {} |",
                if ck { ", checkpointing" } else { "" },
                format_bytes(bytes as i64)
            );
        }
    }
    println!(
        "\nActivation estimates: the measured f32 peak minus gradients above, times {scale:.1} (the \
         ratio of the two configs' channel-times-area volume over every block), times the latent \
         area ratio, halved for bf16. Attention score matrices grow with the square of the area and \
         are not in this linear scaling."
    );
    Ok(())
}
