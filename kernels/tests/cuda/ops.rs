//! Softmax, norms, upsampling, pooling (and conv, linear through candle) against the CPU
//! reference; the NVRTC build of every kernel file; empty tensors launch nothing.

use candle_core::{DType, Device, Result, Tensor, Var};
use ft_kernels::gradcheck::random_tensor;
use ft_kernels::{attention, conv, linear, norm, pool, softmax, upsample};

use super::common::{compare, entry_body, gpu};

/// NVRTC compiles the kernel files for the targets `kernel_arch` picks (needs libnvrtc, not a
/// GPU; CI runs it):
/// the sm_80 build holds the tensor-core attention, an older GPU's build compiles its body out.
#[test]
fn kernels_compile_with_nvrtc() {
    for arch in ["compute_75", "compute_80"] {
        match ft_kernels::cuda::ptx(arch) {
            Ok(ptx) => {
                for entry in [
                    "softmax_fwd_bf16",
                    "attn_bwd_kv_f16",
                    "adamw_bf16_bf16",
                    "adamw8bit_bf16_bf16",
                    "adamw8bit_f32_f32",
                    "unscale_f32",
                    "dropout_bf16",
                    "gated_fwd_bf16",
                    "gated_bwd_f32",
                    "norm_affine_fwd_bf16",
                    "norm_affine_bwd_x_f16",
                    "norm_affine_bwd_params_f32",
                    "sum_squares_bf16",
                    "attn_fwd_tc_bf16",
                    "adafactor_apply_f16_bf16",
                ] {
                    assert!(ptx.contains(entry), "{arch}: PTX lacks {entry}");
                }
                let tc = arch != "compute_75";
                assert_eq!(ptx.contains("mma.sync"), tc, "{arch}: tensor cores {tc}");
                // The optimizer kernels round every operation as the host update does: no
                // multiply-add contracted into an FMA (which rounds once, not twice).
                for entry in [
                    "adamw_bf16_bf16",
                    "adamw8bit_bf16_bf16",
                    "adamw8bit_f32_f32",
                    "adafactor_rows_bf16",
                    "adafactor_col_parts_f32",
                    "adafactor_cols",
                    "adafactor_row_mean",
                    "adafactor_sumsq_f16",
                    "adafactor_apply_bf16_bf16",
                    "adafactor_apply_f32_f32",
                ] {
                    let body = entry_body(ptx, entry);
                    assert!(
                        body.contains("mul.rn.f32"),
                        "{arch}: {entry} body not found"
                    );
                    assert!(
                        !body.contains("fma."),
                        "{arch}: {entry} contracts into an FMA"
                    );
                }
            }
            // CI sets FT_REQUIRE_NVRTC=1: there a missing libnvrtc is a failure, not a skip.
            Err(e)
                if e.to_string().contains("could not be loaded")
                    && std::env::var("FT_REQUIRE_NVRTC").as_deref() != Ok("1") =>
            {
                eprintln!("skipped: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn every_op_matches_its_cpu_reference() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let r = |shape: &[usize], seed: u64| random_tensor(shape, seed, &Device::Cpu);
    compare("softmax", &dev, &[r(&[3, 5, 37], 1)?], |t| {
        softmax::softmax_last_dim(&t[0])
    })?;
    compare("log_softmax", &dev, &[r(&[3, 5, 37], 2)?], |t| {
        softmax::log_softmax_last_dim(&t[0])
    })?;
    compare(
        "layer_norm",
        &dev,
        &[r(&[2, 7, 48], 3)?, r(&[48], 4)?, r(&[48], 5)?],
        |t| norm::layer_norm(&t[0], Some(&t[1]), Some(&t[2]), 1e-5),
    )?;
    compare("rms_norm", &dev, &[r(&[2, 7, 48], 6)?, r(&[48], 7)?], |t| {
        norm::rms_norm(&t[0], Some(&t[1]), 1e-6)
    })?;
    compare(
        "group_norm",
        &dev,
        &[r(&[2, 16, 5, 6], 8)?, r(&[16], 9)?, r(&[16], 10)?],
        |t| norm::group_norm(&t[0], 4, Some(&t[1]), Some(&t[2]), 1e-5),
    )?;
    compare(
        "linear",
        &dev,
        &[r(&[2, 9, 24], 11)?, r(&[40, 24], 12)?, r(&[40], 13)?],
        |t| linear::linear(&t[0].transpose(0, 1)?, &t[1], Some(&t[2])),
    )?;
    compare("upsample_nearest2x", &dev, &[r(&[2, 3, 5, 7], 14)?], |t| {
        upsample::upsample_nearest2x(&t[0])
    })?;
    compare(
        "conv2d 3x3",
        &dev,
        &[r(&[2, 8, 9, 7], 15)?, r(&[12, 8, 3, 3], 16)?, r(&[12], 17)?],
        |t| conv::conv2d(&t[0], &t[1], Some(&t[2]), 1, 1),
    )?;
    compare(
        "conv2d stride 2",
        &dev,
        &[r(&[2, 8, 9, 7], 18)?, r(&[8, 8, 3, 3], 19)?],
        |t| conv::conv2d(&t[0], &t[1], None, 2, 1),
    )?;
    compare(
        "attention with bias",
        &dev,
        &[
            r(&[2, 4, 33, 16], 20)?,
            r(&[2, 4, 77, 16], 21)?,
            r(&[2, 4, 77, 16], 22)?,
            r(&[1, 4, 33, 77], 23)?,
        ],
        |t| attention::sdpa(&t[0], &t[1], &t[2], Some(&t[3]), 0.25),
    )?;
    compare("max_pool2d 3x3/2", &dev, &[r(&[2, 3, 11, 9], 24)?], |t| {
        pool::max_pool2d(&t[0], (3, 3), (2, 2))
    })?;
    compare("avg_pool2d 2x2/2", &dev, &[r(&[2, 3, 10, 7], 25)?], |t| {
        pool::avg_pool2d(&t[0], (2, 2), (2, 2))
    })?;
    compare("max_pool2d 2x3/1", &dev, &[r(&[1, 2, 6, 7], 26)?], |t| {
        pool::max_pool2d(&t[0], (2, 3), (1, 1))
    })?;
    Ok(())
}

/// Empty tensors (no rows, or no batch-heads) launch no kernel and come back empty, with a
/// gradient, where a forced one-block launch would index past the empty buffers.
#[test]
fn empty_tensors_launch_nothing() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let before = ft_kernels::cuda::launches();
    let x = Var::from_tensor(&Tensor::zeros((0, 8), DType::F32, &dev)?)?;
    let y = softmax::softmax_last_dim(x.as_tensor())?;
    assert_eq!(y.dims(), &[0, 8]);
    let g = y.sum_all()?.backward()?;
    assert_eq!(g.get(x.as_tensor()).map(|g| g.elem_count()), Some(0));
    let n = norm::rms_norm(x.as_tensor(), None, 1e-6)?;
    assert_eq!(n.dims(), &[0, 8]);
    let q = Tensor::zeros((0, 2, 16, 64), DType::BF16, &dev)?;
    let o = attention::attend(&q, &q, &q, None, 0.125)?;
    assert_eq!(o.dims(), &[0, 2, 16, 64]);
    // None of those launched a kernel of this crate (a one-block launch over empty buffers would
    // read out of bounds without necessarily faulting).
    assert_eq!(
        ft_kernels::cuda::launches(),
        before,
        "kernels launched for empty tensors"
    );
    // No keys: zeros out, a zero dQ, an empty dK/dV (its kernel's grid is empty).
    let q = Var::from_tensor(&Tensor::ones((1, 2, 16, 64), DType::F32, &dev)?)?;
    let kv = Var::from_tensor(&Tensor::zeros((1, 2, 0, 64), DType::F32, &dev)?)?;
    let o = attention::attend(q.as_tensor(), kv.as_tensor(), kv.as_tensor(), None, 0.125)?;
    assert_eq!(o.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    let g = o.sum_all()?.backward()?;
    let dq = g.get(q.as_tensor()).expect("dQ");
    assert_eq!(dq.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    dev.synchronize()?;
    Ok(())
}

/// The gated feed-forward on CUDA (both forms, every activation) against the CPU's passes:
/// forward and both gradients in f32, the bf16 forward within its precision, and the kernels
/// launched (not candle's fallback).
#[test]
fn gated_matches_the_cpu() -> Result<()> {
    use ft_kernels::activation::Activation;
    use ft_kernels::gated::{gated, gated_halves};
    let Some(dev) = gpu() else { return Ok(()) };
    let r =
        |s: &[usize], seed: u64| -> Result<Tensor> { random_tensor(s, seed, &Device::Cpu)? * 3.0 };
    for (i, act) in [
        Activation::GeluTanh,
        Activation::GeluErf,
        Activation::Silu,
        Activation::Relu,
    ]
    .into_iter()
    .enumerate()
    {
        let before = ft_kernels::cuda::launches_of("gated_");
        let seed = 70 + 3 * i as u64;
        compare(
            &format!("gated {act:?}"),
            &dev,
            &[r(&[3, 5, 67], seed)?, r(&[3, 5, 67], seed + 1)?],
            |t| gated(&t[0], &t[1], act),
        )?;
        compare(
            &format!("gated halves {act:?}"),
            &dev,
            &[r(&[2, 9, 2 * 67], seed + 2)?],
            |t| gated_halves(&t[0], act),
        )?;
        assert!(
            ft_kernels::cuda::launches_of("gated_") > before,
            "{act:?}: the gated kernels did not run"
        );
    }
    Ok(())
}

/// The norms with their weight and bias (and group norm with an activation) as one op: the CUDA
/// forward and backward kernels against the CPU's op.
#[test]
fn norm_affine_matches_the_cpu() -> Result<()> {
    use ft_kernels::activation::Activation;
    let Some(dev) = gpu() else { return Ok(()) };
    let r = |shape: &[usize], seed: u64| random_tensor(shape, seed, &Device::Cpu);
    let before = ft_kernels::cuda::launches_of("norm_affine_");
    compare(
        "group_norm_act silu",
        &dev,
        &[r(&[2, 16, 5, 6], 81)?, r(&[16], 82)?, r(&[16], 83)?],
        |t| norm::group_norm_act(&t[0], 4, Some(&t[1]), Some(&t[2]), 1e-5, Activation::Silu),
    )?;
    compare(
        "group_norm_act silu, no bias, 700-value rows",
        &dev,
        &[r(&[1, 8, 20, 35], 84)?, r(&[8], 85)?],
        |t| norm::group_norm_act(&t[0], 2, Some(&t[1]), None, 1e-5, Activation::Silu),
    )?;
    compare(
        "group_norm_act gelu",
        &dev,
        &[r(&[2, 16, 5, 6], 91)?, r(&[16], 92)?, r(&[16], 93)?],
        |t| {
            norm::group_norm_act(
                &t[0],
                4,
                Some(&t[1]),
                Some(&t[2]),
                1e-5,
                Activation::GeluErf,
            )
        },
    )?;
    compare(
        "rms_norm, 700 wide",
        &dev,
        &[r(&[2, 700], 89)?, r(&[700], 90)?],
        |t| norm::rms_norm(&t[0], Some(&t[1]), 1e-6),
    )?;
    compare(
        "layer_norm, 640 wide",
        &dev,
        &[r(&[3, 640], 86)?, r(&[640], 87)?, r(&[640], 88)?],
        |t| norm::layer_norm(&t[0], Some(&t[1]), Some(&t[2]), 1e-5),
    )?;
    assert!(
        ft_kernels::cuda::launches_of("norm_affine_") > before,
        "the norm_affine kernel did not run"
    );
    Ok(())
}

/// Dropout on CUDA draws the CPU's mask for a seed, so its values are the CPU's bit for bit in
/// each dtype (one multiply, rounded once), and so is the gradient backward draws again.
#[test]
fn dropout_matches_the_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let x = random_tensor(&[3, 1001], 61, &Device::Cpu)?;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = x.to_dtype(dtype)?;
        let cpu = ft_kernels::dropout::dropout(&x, 0.3, 99, 17)?;
        let v = Var::from_tensor(&x.to_device(&dev)?)?;
        let gpu = ft_kernels::dropout::dropout(v.as_tensor(), 0.3, 99, 17)?;
        let (a, b) = (super::common::host(&cpu)?, super::common::host(&gpu)?);
        assert_eq!(a, b, "{dtype:?} values");
        let g = gpu.sum_all()?.backward()?;
        let g = super::common::host(g.get(v.as_tensor()).expect("gradient"))?;
        let ones = Tensor::ones(x.shape(), dtype, &Device::Cpu)?;
        let mask = super::common::host(&ft_kernels::dropout::dropout(&ones, 0.3, 99, 17)?)?;
        assert_eq!(g, mask, "{dtype:?} gradient");
    }
    Ok(())
}
