//! Times the gated feed-forward (`src/cuda/gated.cu`) at FLAN-T5-XL's and the SDXL UNet's
//! shapes: the forward through `gated`/`gated_halves`, and forward plus backward through
//! candle's autograd (the backward one kernel writing both gradients). Each shape is first
//! checked against the CPU reference (the same op on the CPU).
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_gated`

use candle_core::{DType, Device, Result, Tensor, Var};
use ft_kernels::activation::Activation;
use ft_kernels::cuda::check::{gpu, max_rel_diff, report, time_us};
use ft_kernels::gated::{gated, gated_halves};
use ft_kernels::gradcheck::random_tensor;

/// `f` on `inputs` and the gradients of `sum(y)` for each.
fn forward_backward(
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let g = y.sum_all()?.backward()?;
    let grads = ts
        .iter()
        .map(|t| {
            g.get(t)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))
        })
        .collect::<Result<_>>()?;
    Ok((y, grads))
}

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // (name, operands' shape, GEGLU's halves or T5's two tensors, activation)
    let cases: [(&str, [usize; 3], bool, Activation); 3] = [
        // FLAN-T5-XL's encoder feed-forward at batch 8 x 512 tokens.
        ("t5-xl ff", [8, 512, 5120], false, Activation::GeluTanh),
        // The SDXL UNet's GEGLU at 1024 px: 4096 tokens of 640, 1024 of 1280 (width 2 x 4 d).
        (
            "sdxl geglu 640",
            [1, 4096, 2 * 2560],
            true,
            Activation::GeluErf,
        ),
        (
            "sdxl geglu 1280",
            [1, 1024, 2 * 5120],
            true,
            Activation::GeluErf,
        ),
    ];
    for (name, dims, halves, act) in cases {
        let count = if halves { 1 } else { 2 };
        let inputs: Vec<Tensor> = (0..count)
            .map(|i| random_tensor(&dims, 5 + i, &Device::Cpu)?.to_dtype(DType::F32))
            .collect::<Result<_>>()?;
        let f = |t: &[Tensor]| {
            if halves {
                gated_halves(&t[0], act)
            } else {
                gated(&t[0], &t[1], act)
            }
        };
        let (want, want_grads) = forward_backward(&inputs, &f)?;
        for dt in [DType::F32, DType::BF16] {
            let xs: Vec<Tensor> = inputs
                .iter()
                .map(|t| t.to_dtype(dt)?.to_device(&dev))
                .collect::<Result<_>>()?;
            let (y, grads) = forward_backward(&xs, &f)?;
            let tol = if dt == DType::F32 { 1e-4 } else { 2e-2 };
            let err = max_rel_diff(&y, &want)?;
            assert!(err < tol, "{name} {dt:?} forward: {err:.2e}");
            for (g, w) in grads.iter().zip(&want_grads) {
                let err = max_rel_diff(g, w)?;
                assert!(err < tol, "{name} {dt:?} gradient: {err:.2e}");
            }
            // Bytes moved: the forward reads both operands and writes the product; forward and
            // backward together also read the gradient and both operands and write two.
            let n = y.elem_count() * dt.size_in_bytes();
            let us = time_us(&dev, 20, || f(&xs).map(|_| ()))?;
            report(&format!("{name} fwd {dt:?}"), us, Some(3 * n as u64));
            let us = time_us(&dev, 20, || forward_backward(&xs, &f).map(|_| ()))?;
            report(&format!("{name} fwd+bwd {dt:?}"), us, Some(8 * n as u64));
        }
    }
    Ok(())
}
