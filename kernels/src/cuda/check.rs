//! What the GPU checks (`tests/cuda/`, ft-trainer's `tests/cuda/`) and the per-family timing
//! examples (`examples/time_*.rs`) share: the device, the comparison with a CPU reference, and
//! llm.c's `benchmark_kernel` loop (a warm-up run, then `iters` runs between two stream
//! synchronisations).

use candle_core::{DType, Device, Result, Tensor, Var};

/// The first CUDA device, or `None` (said on stderr: the caller skips) where none opens. With
/// `FT_REQUIRE_GPU=1` (as `scripts/gpu-bench.sh` runs the checks) a missing device panics, so a
/// broken driver is no pass.
pub fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("FT_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("FT_REQUIRE_GPU=1 but no CUDA device: {e}")
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// Mean microseconds of `f` over `iters` runs after one warm-up, the device synchronised before
/// and after (kernels are asynchronous: the time is the stream's, not the launch's).
pub fn time_us(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let t0 = std::time::Instant::now();
    for _ in 0..iters.max(1) {
        f()?;
    }
    dev.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64)
}

/// The largest elementwise difference of `got` (any device or dtype) from `want`, relative to
/// `want`'s largest magnitude: the check before timing.
pub fn max_rel_diff(got: &Tensor, want: &Tensor) -> Result<f64> {
    let g = got.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let w = want.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let d = (&g - &w)?.abs()?.max_all()?.to_scalar::<f64>()?;
    Ok(d / w.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-12))
}

/// One line of a timing table: the case, its time and, given the bytes a run reads and writes,
/// the memory bandwidth it reaches.
pub fn report(case: &str, us: f64, bytes: Option<u64>) {
    match bytes {
        Some(b) => println!(
            "{case:<40} {us:>10.1} us {:>8.1} GB/s",
            b as f64 / (us * 1e-6) / 1e9
        ),
        None => println!("{case:<40} {us:>10.1} us"),
    }
}

/// `f` on `inputs` (each made a variable) and the gradients of `sum(y)` for each: what the
/// timing examples check against the CPU and then time.
pub fn forward_backward(
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

/// Panics naming `case` unless the output and every gradient of `got` are within `tol` (max
/// relative difference) of `want`'s.
pub fn assert_matches(
    case: &str,
    got: &(Tensor, Vec<Tensor>),
    want: &(Tensor, Vec<Tensor>),
    tol: f64,
) -> Result<()> {
    let err = max_rel_diff(&got.0, &want.0)?;
    assert!(err < tol, "{case} forward: {err:.2e}");
    for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        let err = max_rel_diff(g, w)?;
        assert!(err < tol, "{case} gradient {i}: {err:.2e}");
    }
    Ok(())
}

/// What an op's timing example does at one shape: `f` on `inputs` (f32, on the CPU) as the
/// reference, then on `dev` in f32 and bf16 checked against it ([`assert_matches`]: 1e-4 in
/// f32, `bf16_tol` in bf16) and timed, forward and forward plus backward, each reported with
/// the bytes it moves as a multiple of the output's (`moves`: forward, both).
pub fn check_and_time(
    dev: &Device,
    name: &str,
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    bf16_tol: f64,
    moves: (u64, u64),
) -> Result<()> {
    let want = forward_backward(inputs, f)?;
    for dt in [DType::F32, DType::BF16] {
        let xs: Vec<Tensor> = inputs
            .iter()
            .map(|t| t.to_dtype(dt)?.to_device(dev))
            .collect::<Result<_>>()?;
        let got = forward_backward(&xs, f)?;
        let tol = if dt == DType::F32 { 1e-4 } else { bf16_tol };
        assert_matches(&format!("{name} {dt:?}"), &got, &want, tol)?;
        let n = (got.0.elem_count() * dt.size_in_bytes()) as u64;
        let us = time_us(dev, 20, || f(&xs).map(|_| ()))?;
        report(&format!("{name} fwd {dt:?}"), us, Some(moves.0 * n));
        let us = time_us(dev, 20, || forward_backward(&xs, f).map(|_| ()))?;
        report(&format!("{name} fwd+bwd {dt:?}"), us, Some(moves.1 * n));
    }
    Ok(())
}
