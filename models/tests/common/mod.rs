//! Shared by the parity tests: fixture paths and the gradient comparison.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use ft_params::weights::SafetensorsFiles;

/// `tests/fixtures/<rel>` at the workspace root.
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

pub fn max_abs(t: &Tensor) -> anyhow::Result<f32> {
    Ok(t.abs()?.max_all()?.to_scalar::<f32>()?)
}

/// max |a - b| / max |b|.
pub fn rel(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    Ok(max_abs(&(a - b)?)? / max_abs(b)?.max(1e-8))
}

/// Compares every reference gradient in `file` with ours (`grads`: name, gradient or None):
/// within `tol` relative, except gradients that are zero in exact arithmetic (the reference's
/// magnitude is below 1e-5 of the largest reference gradient: a bias that a following norm
/// removes, a key bias that softmax ignores, a bias added to every class score), where both
/// sides hold rounding noise and ours must stay below 1e-4 of that largest gradient. Every
/// reference gradient must have a counterpart.
pub fn compare_gradients(
    file: &Path,
    grads: &[(String, Option<Tensor>)],
    tol: f32,
    label: &str,
) -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let want = SafetensorsFiles::open(&[file.to_path_buf()])?;
    let mut global = 0f32;
    for n in want.names() {
        global = global.max(max_abs(&want.load(n, None, DType::F32, &dev, false)?)?);
    }
    let mut compared = 0;
    for (name, g) in grads {
        if want.meta(name).is_none() {
            continue;
        }
        let g = g
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("{label}: `{name}` has no gradient"))?;
        let w = want.load(name, Some(g.dims()), DType::F32, &dev, false)?;
        compared += 1;
        if max_abs(&w)? < 1e-5 * global {
            let ours = max_abs(g)?;
            anyhow::ensure!(
                ours < 1e-4 * global,
                "{label}: `{name}` should be ~0, is {ours}"
            );
            continue;
        }
        let e = rel(g, &w)?;
        anyhow::ensure!(
            e < tol,
            "{label}: gradient of `{name}` differs by {e} relative"
        );
    }
    anyhow::ensure!(
        compared == want.names().count(),
        "{label}: {compared} of {} reference gradients compared",
        want.names().count()
    );
    Ok(())
}

/// The tensors of a fixture file, each fetched by name with an error naming a missing one.
pub struct Fixture(std::collections::HashMap<String, Tensor>);

impl Fixture {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        Ok(Fixture(candle_core::safetensors::load(path, &Device::Cpu)?))
    }

    pub fn get(&self, k: &str) -> anyhow::Result<Tensor> {
        self.0
            .get(k)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("fixture lacks {k}"))
    }
}

/// The gradient `grads` holds for each trainable parameter of `store`, by name (what
/// [`compare_gradients`] takes).
pub fn store_gradients(
    store: &ft_params::ParamStore,
    grads: &candle_core::backprop::GradStore,
) -> anyhow::Result<Vec<(String, Option<Tensor>)>> {
    Ok(store
        .trainable()?
        .into_iter()
        .map(|(n, v)| (n, grads.get(v.as_tensor()).cloned()))
        .collect())
}
