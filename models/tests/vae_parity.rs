//! The VAE against diffusers (fixture from scripts/vae_parity.py): encoder moments, decoder
//! output, and chunked decoding equal to whole-batch decoding.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use ft_models::vae::{Vae, VaeConfig, VaeParts};
use ft_params::weights::SafetensorsFiles;
use ft_params::{ParamBuilder, ParamStore};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vae_tiny")
}

fn rel(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok(d / b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-8))
}

#[test]
fn encode_and_decode_match_diffusers_and_chunking_is_exact() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let cfg = VaeConfig::from_file(&dir().join("config.json"))?;
    let files = Arc::new(SafetensorsFiles::open(&[
        dir().join("diffusion_pytorch_model.safetensors")
    ])?);
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 0)
        .frozen()
        .with_source(files.clone());
    let vae = Vae::new(&pb, &cfg)?;
    assert_eq!(
        store.all().len(),
        files.names().count(),
        "every tensor of the checkpoint is used"
    );
    let out = candle_core::safetensors::load(dir().join("outputs.safetensors"), &dev)?;
    let get = |k: &str| {
        out.get(k)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("fixture lacks {k}"))
    };
    let (mean, logvar) = vae.encode_moments(&get("images")?)?;
    assert!(rel(&mean, &get("mean")?)? < 1e-4, "posterior mean");
    assert!(
        rel(&logvar, &get("logvar")?)? < 1e-4,
        "posterior log-variance"
    );
    let scaled = vae.encode(&get("images")?)?;
    assert!(rel(&scaled, &(get("mean")? * cfg.scaling_factor)?)? < 1e-4);
    let decoded = vae.decode(&get("latents")?)?;
    let e = rel(&decoded, &get("decoded")?)?;
    assert!(e < 1e-4, "decoded images differ by {e}");
    let chunked = vae.decode_chunked(&get("latents")?, 2, 0)?;
    assert!(
        rel(&chunked, &decoded)? < 1e-6,
        "chunked decode equals whole-batch decode"
    );

    // Tiled decoding as diffusers' enable_tiling does it (tiles of 4 latent pixels here).
    let tiled = vae.decode_tiled(&get("tiled_latents")?, 4)?;
    let e = rel(&tiled, &get("tiled")?)?;
    assert!(e < 1e-4, "tiled decode differs by {e}");
    // A tile as large as the latents is plain decoding.
    let whole = vae.decode_tiled(&get("latents")?, 8)?;
    assert!(rel(&whole, &decoded)? < 1e-7);
    assert!(vae.decode_tiled(&get("tiled_latents")?, 1).is_err());

    // The decoder alone (what evaluation keeps): only decoder tensors are loaded, same output.
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 0)
        .frozen()
        .with_source(files.clone());
    let dec = Vae::with_parts(&pb, &cfg, VaeParts::Decoder)?;
    assert!(store
        .all()
        .iter()
        .all(|(n, _)| n.starts_with("decoder.") || n.starts_with("post_quant_conv.")));
    assert!(rel(&dec.decode(&get("latents")?)?, &decoded)? < 1e-7);
    assert!(
        dec.encode(&get("images")?).is_err(),
        "no encoder was loaded"
    );
    Ok(())
}
