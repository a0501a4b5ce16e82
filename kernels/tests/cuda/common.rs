//! What the GPU checks share: the device (or a skip, or a failure under FT_REQUIRE_GPU=1), the
//! comparison with the CPU reference, and reading results back.

use candle_core::{DType, Device, Result, Tensor, Var};
use ft_kernels::gradcheck::random_tensor;

pub use ft_kernels::cuda::check::{gpu, max_rel_diff as rel};

/// Runs `f` on f32 copies of `inputs` on the CPU and on the GPU; compares outputs and the
/// gradients of `sum(w * f(inputs))` for every input.
pub fn compare(
    name: &str,
    dev: &Device,
    inputs: &[Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    let run = |d: &Device| -> Result<(Tensor, Vec<Tensor>)> {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.to_dtype(DType::F32)?.to_device(d)?))
            .collect::<Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts)?;
        let w = random_tensor(y.dims(), 0xBEEF, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_device(d)?;
        let grads = (&y * &w)?.sum_all()?.backward()?;
        let gs = vars
            .iter()
            .map(|v| {
                grads
                    .get(v.as_tensor())
                    .cloned()
                    .unwrap_or(v.as_tensor().zeros_like()?)
                    .to_device(&Device::Cpu)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((y.to_device(&Device::Cpu)?, gs))
    };
    let (y_cpu, g_cpu) = run(&Device::Cpu)?;
    let (y_gpu, g_gpu) = run(dev)?;
    let e = rel(&y_gpu, &y_cpu)?;
    assert!(
        e < 1e-4,
        "{name}: CUDA forward differs from the CPU by {e:.2e}"
    );
    for (i, (a, b)) in g_gpu.iter().zip(&g_cpu).enumerate() {
        let e = rel(a, b)?;
        assert!(e < 1e-4, "{name}: gradient of input {i} differs by {e:.2e}");
    }
    // bf16 forward within its precision of the f32 CPU result.
    let low: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::BF16)?.to_device(dev))
        .collect::<Result<_>>()?;
    let e = rel(&f(&low)?, &y_cpu)?;
    assert!(e < 2e-2, "{name}: bf16 CUDA forward differs by {e:.2e}");
    eprintln!("{name}: matches the CPU reference");
    Ok(())
}

/// The PTX of one entry point: from its `.entry` line to the next entry (or the end).
pub fn entry_body<'a>(ptx: &'a str, entry: &str) -> &'a str {
    let Some(start) = ptx.find(&format!(".entry {entry}(")) else {
        return "";
    };
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").unwrap_or(rest.len());
    &rest[..end]
}

pub fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1()
}
