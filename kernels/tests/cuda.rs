//! The CUDA path of every op the models use, against the CPU reference on fresh random inputs
//! (the kernels of `ft_kernels::cuda` included):
//! forward values and the gradient of a random weighting of the output, in f32 (within 1e-4
//! relative) and bf16 forwards (within 2e-2). Built only with `--features cuda`; each test
//! returns early, saying so, when no GPU can be opened (a CUDA build on a machine without one).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Result, Tensor, Var};
use ft_kernels::gradcheck::random_tensor;
use ft_kernels::{attention, conv, linear, norm, pool, rounding, softmax, upsample};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        // `scripts/gpu-bench.sh` sets FT_REQUIRE_GPU=1: there a missing device is a failure.
        Err(e) if std::env::var("FT_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("FT_REQUIRE_GPU=1 but no CUDA device: {e}")
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

fn rel(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let d = (&a - &b)?.abs()?.max_all()?.to_scalar::<f64>()?;
    Ok(d / b.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-12))
}

/// Runs `f` on f32 copies of `inputs` on the CPU and on the GPU; compares outputs and the
/// gradients of `sum(w * f(inputs))` for every input.
fn compare(
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
fn entry_body<'a>(ptx: &'a str, entry: &str) -> &'a str {
    let Some(start) = ptx.find(&format!(".entry {entry}(")) else {
        return "";
    };
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").unwrap_or(rest.len());
    &rest[..end]
}

/// NVRTC compiles kernels.cu for the targets `kernel_arch` picks (needs libnvrtc, not a GPU):
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
            Err(e) if e.to_string().contains("could not be loaded") => {
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

/// The fused attention kernels (64-dim heads) against `sdpa` on the CPU: `attend` picks the
/// kernels on CUDA and `sdpa` on the CPU. Lengths are not multiples of the 64-row tiles; the
/// bias cases check its gradient (a [1, H, Lq, Lk] position bias broadcast over the batch, a
/// [B, 1, 1, Lk] padding mask with large negatives).
#[test]
fn fused_attention_matches_sdpa() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let r = |shape: &[usize], seed: u64| random_tensor(shape, seed, &Device::Cpu);
    compare(
        "fused attention, self",
        &dev,
        &[
            r(&[2, 3, 130, 64], 30)?,
            r(&[2, 3, 130, 64], 31)?,
            r(&[2, 3, 130, 64], 32)?,
        ],
        |t| attention::attend(&t[0], &t[1], &t[2], None, 0.125),
    )?;
    compare(
        "fused attention, cross with position bias",
        &dev,
        &[
            r(&[2, 4, 70, 64], 33)?,
            r(&[2, 4, 77, 64], 34)?,
            r(&[2, 4, 77, 64], 35)?,
            r(&[1, 4, 70, 77], 36)?,
        ],
        |t| attention::attend(&t[0], &t[1], &t[2], Some(&t[3]), 1.0),
    )?;
    // Padding mask: the last 9 keys of the second sequence are masked out.
    let mask: Vec<f32> = (0..2 * 40)
        .map(|i| if i >= 40 + 31 { -1e9 } else { 0.0 })
        .collect();
    let mask = Tensor::from_vec(mask, (2, 1, 1, 40), &Device::Cpu)?;
    compare(
        "fused attention, padding mask",
        &dev,
        &[
            r(&[2, 2, 40, 64], 37)?,
            r(&[2, 2, 40, 64], 38)?,
            r(&[2, 2, 40, 64], 39)?,
        ],
        |t| {
            let m = mask.to_device(t[0].device())?.to_dtype(t[0].dtype())?;
            attention::attend(&t[0], &t[1], &t[2], Some(&m), 0.125)
        },
    )?;
    // bf16 gradients (the tensor-core backward on sm_80+) against the f32 CPU gradients.
    let inputs = [
        r(&[2, 3, 100, 64], 43)?,
        r(&[2, 3, 90, 64], 44)?,
        r(&[2, 3, 90, 64], 45)?,
        r(&[1, 3, 100, 90], 46)?,
    ];
    let grads_on = |d: &Device, dt: DType| -> Result<Vec<Tensor>> {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.to_dtype(dt)?.to_device(d)?))
            .collect::<Result<_>>()?;
        let t: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = attention::attend(&t[0], &t[1], &t[2], Some(&t[3]), 0.125)?;
        let w = random_tensor(y.dims(), 47, &Device::Cpu)?
            .to_dtype(dt)?
            .to_device(d)?;
        let g = (y * w)?.sum_all()?.backward()?;
        vars.iter()
            .map(|v| {
                g.get(v.as_tensor())
                    .cloned()
                    .ok_or_else(|| candle_core::Error::Msg("missing gradient".into()))
            })
            .collect()
    };
    let cpu = grads_on(&Device::Cpu, DType::F32)?;
    let gpu = grads_on(&dev, DType::BF16)?;
    for (i, (a, b)) in gpu.iter().zip(&cpu).enumerate() {
        let e = rel(a, b)?;
        assert!(
            e < 3e-2,
            "bf16 attention gradient of input {i} differs by {e:.2e}"
        );
    }
    // The memory-efficient entry point takes the same kernels on CUDA.
    let q = r(&[1, 2, 65, 64], 40)?;
    let k = r(&[1, 2, 33, 64], 41)?;
    let v = r(&[1, 2, 33, 64], 42)?;
    let cpu = attention::sdpa(&q, &k, &v, None, 0.125)?;
    let gpu = attention::sdpa_memory_efficient(
        &q.to_device(&dev)?,
        &k.to_device(&dev)?,
        &v.to_device(&dev)?,
        None,
        0.125,
        64,
    )?;
    let e = rel(&gpu, &cpu)?;
    assert!(e < 1e-4, "sdpa_memory_efficient on CUDA differs by {e:.2e}");
    Ok(())
}

fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1()
}

/// The fused AdamW step against torch.optim.AdamW's formula in f64, for the first step (moments
/// ignored) and a later one, with a bf16 gradient and the bf16 model weight written in the same
/// pass (round to nearest of the new master).
#[test]
fn fused_adamw_matches_the_formula() -> Result<()> {
    use ft_kernels::cuda::{adamw_fused, AdamWStep};
    let Some(dev) = gpu() else { return Ok(()) };
    let n = 1000;
    let r = |seed: u64| -> Result<Tensor> {
        random_tensor(&[n], seed, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_device(&dev)
    };
    let master = r(50)?;
    let m = r(51)?;
    let v = r(52)?.abs()?;
    let grad = r(53)?.to_dtype(DType::BF16)?;
    let model = master.to_dtype(DType::BF16)?;
    for (t, first) in [(1, true), (7, false)] {
        let (p0, m0, v0, g0) = (host(&master)?, host(&m)?, host(&v)?, host(&grad)?);
        let (lr, b1, b2, eps, wd, gm) = (1e-3, 0.9, 0.999, 1e-8, 0.01, 0.5);
        let s = AdamWStep {
            lr,
            beta1: b1,
            beta2: b2,
            eps,
            weight_decay: wd,
            step_size: lr / (1.0 - f64::powi(b1, t)),
            bc2_sqrt: (1.0 - f64::powi(b2, t)).sqrt(),
            grad_mul: gm,
            first,
            seed: 0,
        };
        adamw_fused(&master, &m, &v, &grad, Some(&model), &s)?;
        let (p1, m1, v1, w1) = (host(&master)?, host(&m)?, host(&v)?, host(&model)?);
        for i in 0..n {
            let g = g0[i] * gm;
            let (mp, vp) = if first { (0.0, 0.0) } else { (m0[i], v0[i]) };
            let me = b1 * mp + (1.0 - b1) * g;
            let ve = b2 * vp + (1.0 - b2) * g * g;
            let pe = p0[i] * (1.0 - lr * wd) - s.step_size * me / (ve.sqrt() / s.bc2_sqrt + eps);
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
            assert!(close(m1[i], me), "exp_avg[{i}]: {} vs {me}", m1[i]);
            assert!(close(v1[i], ve), "exp_avg_sq[{i}]: {} vs {ve}", v1[i]);
            assert!(close(p1[i], pe), "master[{i}]: {} vs {pe}", p1[i]);
            let nearest = half::bf16::from_f64(p1[i]).to_f64();
            assert_eq!(w1[i], nearest, "bf16 weight[{i}] is not the rounded master");
        }
    }
    Ok(())
}

/// Unscale + inf check + cast in one pass: values divided, fp32 out, the flag set only when a
/// gradient holds inf or NaN.
#[test]
fn unscale_check_finds_overflow() -> Result<()> {
    use ft_kernels::cuda::unscale_check;
    let Some(dev) = gpu() else { return Ok(()) };
    let a = Tensor::new(&[2.0f32, -4.0, 8.0], &dev)?.to_dtype(DType::F16)?;
    let b = Tensor::new(&[[1.0f32, 3.0], [5.0, 7.0]], &dev)?.to_dtype(DType::BF16)?;
    let mut grads = vec![Some(a.clone()), None, Some(b.clone())];
    assert!(!unscale_check(&mut grads, 0.5)?);
    let g0 = grads[0].as_ref().map(host).transpose()?;
    assert_eq!(g0, Some(vec![1.0, -2.0, 4.0]));
    assert_eq!(grads[2].as_ref().map(|g| g.dtype()), Some(DType::F32));
    let bad = Tensor::new(&[1.0f32, f32::INFINITY], &dev)?;
    let mut grads = vec![Some(a), Some(bad)];
    assert!(unscale_check(&mut grads, 1.0)?);
    let nan = Tensor::new(&[f32::NAN], &dev)?.to_dtype(DType::BF16)?;
    assert!(unscale_check(&mut [Some(nan)], 1.0)?);
    Ok(())
}

/// The global-norm reduction: every gradient's squares in one f64 total.
#[test]
fn sum_squares_matches_the_host() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let a = random_tensor(&[100_003], 70, &Device::Cpu)?.to_dtype(DType::F32)?;
    let b = random_tensor(&[17, 5], 71, &Device::Cpu)?.to_dtype(DType::BF16)?;
    let want: f64 = [&a, &b]
        .iter()
        .map(|t| host(t).map(|v| v.iter().map(|x| x * x).sum::<f64>()))
        .sum::<Result<f64>>()?;
    let grads = [Some(a.to_device(&dev)?), None, Some(b.to_device(&dev)?)];
    let got = ft_kernels::cuda::sum_squares(&grads)?;
    assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
    // Each tensor's apart, one slot each (a strided f16 view among them): the per-tensor norms
    // of a fused backward pass's clipping.
    let c = random_tensor(&[40, 30], 72, &Device::Cpu)?
        .to_dtype(DType::F16)?
        .t()?;
    let each = [&a, &b, &c];
    let want: Vec<f64> = each
        .iter()
        .map(|t| host(t).map(|v| v.iter().map(|x| x * x).sum::<f64>()))
        .collect::<Result<_>>()?;
    let on_gpu: Vec<Tensor> = each
        .iter()
        .map(|t| t.to_device(&dev))
        .collect::<candle_core::Result<_>>()?;
    let got = ft_kernels::cuda::sum_squares_each(&on_gpu)?;
    assert_eq!(got.len(), 3);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-6 * w, "tensor {i}: {g} vs {w}");
    }
    Ok(())
}

/// Stochastic rounding on CUDA gives the CPU version's bits for the same seed.
#[test]
fn stochastic_rounding_matches_the_cpu() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let x = random_tensor(&[4097], 60, &Device::Cpu)?.to_dtype(DType::F32)?;
    let cpu = rounding::round_stochastic_bf16(&x, 1234)?;
    let gpu = rounding::round_stochastic_bf16(&x.to_device(&dev)?, 1234)?;
    let a: Vec<u16> = cpu
        .to_vec1::<half::bf16>()?
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let b: Vec<u16> = gpu
        .to_device(&Device::Cpu)?
        .to_vec1::<half::bf16>()?
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(a, b);
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
