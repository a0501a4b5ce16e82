//! What the optimizer GPU checks share: the device (or a skip, or a failure under
//! FT_REQUIRE_GPU=1), seeded bf16 parameters and gradients, host copies, tolerances.

use candle_core::{DType, Device, Tensor, Var};
use ft_kernels::gradcheck::random_tensor;
use ft_trainer::optim::adamw8bit::AdamW8bit;
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer};

pub use ft_kernels::cuda::check::gpu;

pub fn host(t: &Tensor) -> anyhow::Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

/// Named bf16 parameters of these shapes on `d`, seeded by their index (the same values on
/// every device).
pub fn bf16_params(shapes: &[&[usize]], d: &Device) -> anyhow::Result<Vec<(String, Var)>> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let t = random_tensor(s, i as u64, &Device::Cpu)?.to_dtype(DType::BF16)?;
            Ok((format!("p{i}"), Var::from_tensor(&t.to_device(d)?)?))
        })
        .collect()
}

/// One bf16 gradient per shape on `d`, seeded from `seed` and the index.
pub fn bf16_grads(
    shapes: &[&[usize]],
    seed: u64,
    d: &Device,
) -> anyhow::Result<Vec<Option<Tensor>>> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let g = random_tensor(s, seed + i as u64, &Device::Cpu)?;
            Ok(Some(g.to_dtype(DType::BF16)?.to_device(d)?))
        })
        .collect()
}

/// Whether the project's CUDA kernels are on; says why a test skips when not.
pub fn kernels_on() -> bool {
    let on = ft_kernels::cuda::enabled();
    if !on {
        eprintln!("skipped: FT_CUDA_KERNELS is off");
    }
    on
}

/// Host copies of each parameter's values.
pub type Values = Vec<Vec<f32>>;

/// What a run leaves: masters, model weights, AdamW moments, the global norm of each step.
pub struct Run {
    pub masters: Values,
    pub model: Values,
    pub moments: Values,
    pub norms: Vec<f64>,
}

pub fn close(what: &str, a: &Values, b: &Values, tol: f32) {
    for (i, (a, b)) in a.iter().zip(b).enumerate() {
        assert_eq!(a.len(), b.len(), "{what} {i}: lengths");
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= tol * y.abs().max(1.0),
                "{what} {i}: {x} vs {y}"
            );
        }
    }
}

/// The optimizer a test builds: 32-bit AdamW, or the 8-bit one.
pub fn optimizer(eight_bit: bool) -> impl FnOnce(usize) -> Box<dyn Optimizer> {
    move |n| -> Box<dyn Optimizer> {
        if eight_bit {
            Box::new(AdamW8bit::new(n, AdamWConfig::default()))
        } else {
            Box::new(AdamW::new(n, AdamWConfig::default()))
        }
    }
}
