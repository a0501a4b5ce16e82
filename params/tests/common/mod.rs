//! Shared by the tests of ft-params and ft-trainer (included with `mod common;`; ft-trainer's
//! `tests/common/mod.rs` includes this file): exact comparisons, and a deep stack of
//! checkpointed layers. Not every test uses every helper.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var};
use ft_params::checkpoint::{Checkpointer, SegmentFn};
use ft_params::weights::SafetensorsFiles;
use ft_params::{Init, ParamBuilder, ParamStore};

/// The bit patterns of a tensor's values widened to f32 (exact for bf16 and f16), flattened:
/// for tests that two paths give the same bits, not merely close values.
#[allow(dead_code)]
pub fn bits(t: &Tensor) -> Result<Vec<u32>> {
    let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    Ok(v.iter().map(|x| x.to_bits()).collect())
}

#[allow(dead_code)]
pub struct Layer {
    pub w: Tensor,
    pub b: Tensor,
    pub params: Vec<Var>,
}

/// A deep residual MLP: `x + tanh(x W^T + b) * 0.5`, each layer one checkpoint segment.
#[allow(dead_code)]
pub fn stack(depth: usize, width: usize) -> anyhow::Result<(Arc<ParamStore>, Vec<Layer>)> {
    stack_of(DType::F32, depth, width)
}

#[allow(dead_code)]
pub fn stack_of(
    dtype: DType,
    depth: usize,
    width: usize,
) -> anyhow::Result<(Arc<ParamStore>, Vec<Layer>)> {
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), dtype, &Device::Cpu, 7);
    let mut layers = Vec::new();
    for i in 0..depth {
        let p = pb.pp(format!("layer.{i}"));
        let w = p.get(&[width, width], "weight", Init::Normal { std: 0.3 })?;
        let b = p.get(&[width], "bias", Init::Uniform { bound: 0.1 })?;
        let params = vec![Var::from_tensor(&w)?, Var::from_tensor(&b)?];
        layers.push(Layer { w, b, params });
    }
    Ok((store, layers))
}

/// The stack's trainable parameters, named `layer.param`, in order.
#[allow(dead_code)]
pub fn named_params(layers: &[Layer]) -> Vec<(String, Var)> {
    layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            l.params
                .iter()
                .enumerate()
                .map(move |(k, v)| (format!("{i}.{k}"), v.clone()))
        })
        .collect()
}

#[allow(dead_code)]
pub fn layer_fn(l: &Layer) -> SegmentFn {
    let (w, b) = (l.w.clone(), l.b.clone());
    Arc::new(move |xs: &[Tensor]| {
        let h = xs[0].matmul(&w.t()?)?.broadcast_add(&b)?.tanh()?;
        // Several temporaries per layer, as in a real block.
        let h = (h.sqr()? * 0.5)?.exp()?.log()?;
        &xs[0] + (h * 0.5)?
    })
}

#[allow(dead_code)]
pub fn loss_and_grads(
    layers: &[Layer],
    x: &Tensor,
    ck: &Checkpointer,
    params: &[Var],
) -> anyhow::Result<(f32, Vec<Option<Tensor>>)> {
    let mut h = x.clone();
    for l in layers {
        h = ck.run(layer_fn(l), &[&h], &l.params)?;
    }
    let loss = h.sqr()?.mean_all()?;
    let value = loss.to_scalar::<f32>()?;
    let grads = ck.gradients(&loss, params)?;
    Ok((value, grads))
}

// ---- a little model saved as safetensors ----

#[allow(dead_code)]
pub fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ftw-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A little model: a few tensors of different sizes, values that are not round in bf16.
#[allow(dead_code)]
pub fn tensors(dtype: DType) -> anyhow::Result<Vec<(String, Tensor)>> {
    let dev = Device::Cpu;
    let shapes: [(&str, &[usize]); 4] = [
        ("embed.weight", &[300, 64]),
        ("block.0.attn.q.weight", &[64, 64]),
        ("block.0.norm.weight", &[64]),
        ("head.weight", &[500, 64]),
    ];
    let mut out = Vec::new();
    for (i, (name, shape)) in shapes.iter().enumerate() {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|j| ((j * 7 + i * 13) % 97) as f32 / 97.0 - 0.5 + 1e-4)
            .collect();
        out.push((
            name.to_string(),
            Tensor::from_vec(v, *shape, &dev)?.to_dtype(dtype)?,
        ));
    }
    Ok(out)
}

#[allow(dead_code)]
pub fn write(path: &Path, ts: &[(String, Tensor)]) -> anyhow::Result<()> {
    ft_params::fs::save_safetensors(ts, path)?;
    Ok(())
}

#[allow(dead_code)]
pub fn build(
    files: Arc<SafetensorsFiles>,
    dtype: DType,
    shapes: &[(String, Vec<usize>)],
) -> anyhow::Result<Arc<ParamStore>> {
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), dtype, &Device::Cpu, 0).with_source(files);
    for (name, shape) in shapes {
        pb.get(shape, name, Init::Zeros)?;
    }
    Ok(store)
}

#[allow(dead_code)]
pub fn shapes_of(ts: &[(String, Tensor)]) -> Vec<(String, Vec<usize>)> {
    ts.iter()
        .map(|(n, t)| (n.clone(), t.dims().to_vec()))
        .collect()
}
