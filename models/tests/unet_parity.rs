//! The SDXL UNet against diffusers (fixture from scripts/unet_parity.py): output and every
//! parameter gradient, plain and with every ResNet/transformer block checkpointed.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ft_models::unet::{UNet, UNetConfig};
use ft_params::checkpoint::{Checkpointer, Strategy};
use ft_params::weights::SafetensorsFiles;
use ft_params::{ParamBuilder, ParamStore};

fn dir() -> PathBuf {
    common::fixture("unet_tiny")
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
    let params: Vec<(String, Var)> = store.trainable()?;
    let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
    let mut plain: Option<Vec<Option<Tensor>>> = None;
    for checkpointing in [
        Strategy::None,
        Strategy::Blocks,
        Strategy::Full,
        Strategy::FullHost,
        Strategy::Every(2),
    ] {
        let ck = Checkpointer::with_strategy(checkpointing);
        let (te, ids) = (get("text_embeds")?, get("time_ids")?);
        let out = unet.forward(&get("x")?, &t, &get("context")?, Some((&te, &ids)), &ck)?;
        let want = get("out")?;
        let e = common::rel(&out, &want)?;
        assert!(
            e < 1e-4,
            "output differs by {e} (checkpointing {checkpointing})"
        );
        let loss = (out * get("w")?)?.sum_all()?;
        let grads = ck.gradients(&loss, &vars)?;
        // Every strategy gives plain backprop's gradients, up to the order in which the time
        // embedding (read by every resnet segment) sums its contributions.
        match &plain {
            None => plain = Some(grads.clone()),
            Some(p) => {
                for ((name, _), (a, b)) in params.iter().zip(p.iter().zip(&grads)) {
                    let (Some(a), Some(b)) = (a, b) else {
                        anyhow::bail!("{checkpointing}: `{name}` has no gradient");
                    };
                    let e = common::rel(b, a)?;
                    assert!(
                        e < 1e-5,
                        "{checkpointing}: `{name}` differs from plain by {e}"
                    );
                }
            }
        }
        let named: Vec<(String, Option<Tensor>)> =
            params.iter().map(|(n, _)| n.clone()).zip(grads).collect();
        let label = format!("checkpointing {checkpointing}");
        common::compare_gradients(&dir().join("grads.safetensors"), &named, 1e-4, &label)?;
    }
    Ok(())
}
