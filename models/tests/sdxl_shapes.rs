//! The full SDXL UNet built from its real config (configs/sdxl/unet_config.json) in shapes-only
//! mode: the parameter count and tensor count diffusers 0.35.2 reports for the same config
//! (2,567,463,684 in 1,680 tensors), without allocating 10 GB.

use std::path::Path;

use candle_core::{DType, Device};
use ft_models::unet::{UNet, UNetConfig};
use ft_params::{ParamBuilder, ParamStore};

#[test]
fn full_sdxl_unet_has_diffusers_parameter_count() -> anyhow::Result<()> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sdxl/unet_config.json");
    let cfg = UNetConfig::from_file(&path)?;
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), DType::BF16, &Device::Cpu, 0).shapes_only();
    UNet::new(&pb, &cfg)?;
    let (n, bytes) = store.count(true);
    assert_eq!(n, 2_567_463_684);
    assert_eq!(bytes, 2 * 2_567_463_684);
    assert_eq!(store.all().len(), 1680);
    Ok(())
}
