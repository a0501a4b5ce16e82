//! The SDXL UNet against diffusers (fixture from scripts/unet_parity.py): output and every
//! parameter gradient, plain and with every ResNet/transformer block checkpointed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ft_memory::checkpoint::Checkpointer;
use ft_memory::weights::{ParamBuilder, ParamStore, SafetensorsFiles};
use ft_models::unet::{UNet, UNetConfig};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/unet_tiny")
}

fn m(t: &Tensor) -> anyhow::Result<f32> {
    Ok(t.abs()?.max_all()?.to_scalar::<f32>()?)
}

#[test]
fn output_and_every_gradient_match_diffusers_with_and_without_checkpointing() -> anyhow::Result<()>
{
    let dev = Device::Cpu;
    let cfg = UNetConfig::from_file(&dir().join("config.json"))?;
    let files = Arc::new(SafetensorsFiles::open(&[
        dir().join("diffusion_pytorch_model.safetensors")
    ])?);
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::F32, &dev, 0).with_source(files.clone());
    let unet = UNet::new(&pb, &cfg)?;
    assert_eq!(
        store.all().len(),
        files.names().count(),
        "every tensor of the checkpoint is used"
    );
    let inp = candle_core::safetensors::load(dir().join("inputs.safetensors"), &dev)?;
    let get = |k: &str| {
        inp.get(k)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("fixture lacks {k}"))
    };
    let t: Vec<f32> = get("timesteps")?.to_vec1()?;
    let want_grads = SafetensorsFiles::open(&[dir().join("grads.safetensors")])?;
    let mut global = 0f32;
    for n in want_grads.names() {
        global = global.max(m(&want_grads.load(n, None, DType::F32, &dev, false)?)?);
    }
    let params: Vec<(String, Var)> = store.trainable()?;
    let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
    for checkpointing in [false, true] {
        let ck = Checkpointer::new(checkpointing);
        let (te, ids) = (get("text_embeds")?, get("time_ids")?);
        let out = unet.forward(&get("x")?, &t, &get("context")?, Some((&te, &ids)), &ck)?;
        let want = get("out")?;
        let e = m(&(&out - &want)?)? / m(&want)?;
        assert!(
            e < 1e-4,
            "output differs by {e} (checkpointing {checkpointing})"
        );
        let loss = (out * get("w")?)?.sum_all()?;
        let grads = ck.gradients(&loss, &vars)?;
        let mut n = 0;
        for ((name, _), g) in params.iter().zip(&grads) {
            let g = g
                .as_ref()
                .unwrap_or_else(|| panic!("`{name}` has no gradient"));
            let w = want_grads.load(name, Some(g.dims()), DType::F32, &dev, false)?;
            n += 1;
            if m(&w)? < 1e-5 * global {
                // Zero in exact arithmetic (a bias that a following norm removes): both sides
                // hold rounding noise only.
                assert!(m(g)? < 1e-4 * global, "`{name}` should be ~0");
                continue;
            }
            let e = m(&(g - &w)?)? / m(&w)?;
            assert!(
                e < 1e-4,
                "gradient of `{name}` differs by {e} (checkpointing {checkpointing})"
            );
        }
        assert_eq!(n, want_grads.names().count());
    }
    Ok(())
}
