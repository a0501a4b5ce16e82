//! 8-bit AdamW (`--optim adamw8bit`): bitsandbytes' dynamic map, blockwise quantization error,
//! training that follows fp32 AdamW, about 2 bytes of state per parameter, exact resume, and
//! clear errors for state of the other kind.

use candle_core::{DType, Device, Tensor, Var};
use ft_trainer::optim::adamw8bit::{dynamic_map, nearest, AdamW8bit, BLOCK};
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer};

mod common;
use common::bits;

fn randn(shape: &[usize], seed: u64, scale: f64) -> anyhow::Result<Tensor> {
    let mut rng = ft_params::rng::SplitMix64::new(seed);
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| (rng.normal() * scale) as f32).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

#[test]
fn dynamic_maps_are_bitsandbytes() {
    let s = dynamic_map(true);
    let u = dynamic_map(false);
    for map in [&s, &u] {
        assert!(
            map.windows(2).all(|w| w[0] < w[1]),
            "256 distinct ascending values"
        );
        assert_eq!(map[255], 1.0);
        assert!(map.contains(&0.0));
    }
    // Signed: 127 values per sign, mirrored; the smallest magnitude 0.55e-6 (the mean of
    // linspace(0.1, 1, 2) in the lowest decade), the largest below 1 the last mean of
    // linspace(0.1, 1, 65).
    for v in s.iter().filter(|v| **v > 0.0 && **v < 1.0) {
        assert!(s.contains(&-v), "{v} has no negative");
    }
    assert_eq!(s.iter().filter(|v| **v < 0.0).count(), 127);
    let tiny = s.iter().filter(|v| **v > 0.0).fold(1f32, |a, v| a.min(*v));
    assert!((tiny - 5.5e-7).abs() < 1e-12, "{tiny}");
    assert!((s[254] - 0.992_968_75).abs() < 1e-7, "{}", s[254]);
    // Unsigned: nothing negative, twice the resolution (linspace(0.1, 1, 129) at the top).
    assert!(u.iter().all(|v| *v >= 0.0));
    assert!((u[254] - 0.996_484_4).abs() < 1e-6, "{}", u[254]);
    assert_eq!(nearest(&s, 1.0), 255);
    assert_eq!(s[nearest(&s, 0.0) as usize], 0.0);
    assert_eq!(s[nearest(&s, -1.0) as usize], s[0]);
}

fn least_squares(opt: &mut dyn Optimizer, steps: usize) -> anyhow::Result<(Vec<f32>, Var)> {
    // W: 32 x 256 = 8,192 weights (8-bit moments), b: 32 (fp32 moments under 4,096).
    let w = Var::from_tensor(&randn(&[32, 256], 1, 0.05)?)?;
    let b = Var::from_tensor(&Tensor::zeros(32, DType::F32, &Device::Cpu)?)?;
    let x = randn(&[512, 256], 2, 1.0)?;
    let target = randn(&[512, 32], 3, 1.0)?;
    let mut losses = Vec::new();
    for _ in 0..steps {
        let y = x
            .matmul(&w.as_tensor().t()?)?
            .broadcast_add(b.as_tensor())?;
        let loss = (y - &target)?.sqr()?.mean_all()?;
        losses.push(loss.to_scalar::<f32>()?);
        let g = loss.backward()?;
        let grads = vec![g.get(w.as_tensor()).cloned(), g.get(b.as_tensor()).cloned()];
        opt.step(&[w.clone(), b.clone()], &grads, 1e-2)?;
    }
    Ok((losses, w))
}

/// On a least-squares fit the 8-bit optimizer's loss curve stays within 2% of fp32 AdamW's, and
/// its weights end within 2% (relative L2) of fp32 AdamW's (measured: 0.8%).
#[test]
fn eight_bit_adamw_follows_fp32_adamw() -> anyhow::Result<()> {
    let cfg = AdamWConfig::default();
    let (full, w32) = least_squares(&mut AdamW::new(2, cfg), 60)?;
    let (q8, w8) = least_squares(&mut AdamW8bit::new(2, cfg), 60)?;
    assert!(
        full[59] < 0.5 * full[0],
        "the fit learns: {} -> {}",
        full[0],
        full[59]
    );
    for (i, (a, b)) in q8.iter().zip(&full).enumerate() {
        assert!(
            (a - b).abs() <= 0.02 * b,
            "step {i}: 8-bit loss {a} vs fp32 {b}"
        );
    }
    // Relative L2 distance of the weights (512 samples for 256 inputs: one solution).
    let norm =
        |t: &Tensor| -> anyhow::Result<f32> { Ok(t.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?) };
    let rel = norm(&(w8.as_tensor() - w32.as_tensor())?)? / norm(w32.as_tensor())?;
    eprintln!(
        "final loss fp32 {} 8-bit {}; relative weight distance {rel}",
        full[59], q8[59]
    );
    assert!(rel <= 0.02, "weights differ by {rel} (relative L2)");
    Ok(())
}

/// State: one byte per moment value plus an fp32 maximum per 256-value block for large
/// tensors, fp32 moments for small ones; small tensors update bit for bit as fp32 AdamW.
#[test]
fn eight_bit_state_is_about_two_bytes_per_parameter() -> anyhow::Result<()> {
    let cfg = AdamWConfig::default();
    let big = Var::from_tensor(&randn(&[40_000], 1, 1.0)?)?;
    let small = Var::from_tensor(&randn(&[100], 2, 1.0)?)?;
    let small32 = Var::from_tensor(small.as_tensor())?;
    let mut q = AdamW8bit::new(2, cfg);
    let mut f = AdamW::new(1, cfg);
    for step in 0..3 {
        let gb = randn(&[40_000], 10 + step, 1.0)?;
        let gs = randn(&[100], 20 + step, 1.0)?;
        q.step(
            &[big.clone(), small.clone()],
            &[Some(gb), Some(gs.clone())],
            1e-3,
        )?;
        f.step(std::slice::from_ref(&small32), &[Some(gs)], 1e-3)?;
    }
    let blocks = 40_000usize.div_ceil(BLOCK) as u64;
    assert_eq!(q.state_bytes(), 2 * 40_000 + 2 * 4 * blocks + 2 * 4 * 100);
    assert_eq!(bits(small.as_tensor())?, bits(small32.as_tensor())?);
    Ok(())
}

/// Saved 8-bit state restores (one tensor at a time, as the trainer reads a checkpoint) and the
/// next step is the uninterrupted one's; fp32 moments of a 32-bit AdamW checkpoint are quantized
/// on restore; 8-bit moments given to the 32-bit AdamW are refused, naming the tensor.
#[test]
fn eight_bit_state_resumes_exactly_and_refuses_the_wrong_kind() -> anyhow::Result<()> {
    let cfg = AdamWConfig::default();
    let w0 = randn(&[5000], 1, 1.0)?;
    let grad = |s: u64| -> anyhow::Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(randn(&[5000], 100 + s, 1.0)?)])
    };
    let a_w = Var::from_tensor(&w0)?;
    let mut a = AdamW8bit::new(1, cfg);
    a.step(std::slice::from_ref(&a_w), &grad(0)?, 1e-3)?;
    let (t, state) = a.state();
    assert_eq!(state.len(), 4);
    let b_w = Var::from_tensor(a_w.as_tensor())?;
    let mut b = AdamW8bit::new(1, cfg);
    for (name, tensor) in &state {
        b.load_state(t, &[(name.clone(), tensor.clone())])?;
    }
    a.step(std::slice::from_ref(&a_w), &grad(1)?, 1e-3)?;
    b.step(std::slice::from_ref(&b_w), &grad(1)?, 1e-3)?;
    assert_eq!(bits(a_w.as_tensor())?, bits(b_w.as_tensor())?);

    // From fp32 AdamW's state: quantized, and the step lands close to fp32 AdamW's own.
    let f_w = Var::from_tensor(&w0)?;
    let mut f = AdamW::new(1, cfg);
    f.step(std::slice::from_ref(&f_w), &grad(0)?, 1e-3)?;
    let (t, fstate) = f.state();
    let c_w = Var::from_tensor(f_w.as_tensor())?;
    let mut c = AdamW8bit::new(1, cfg);
    c.load_state(t, &fstate)?;
    f.step(std::slice::from_ref(&f_w), &grad(1)?, 1e-3)?;
    c.step(std::slice::from_ref(&c_w), &grad(1)?, 1e-3)?;
    let diff = (f_w.as_tensor() - c_w.as_tensor())?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert!(
        diff < 2e-4,
        "8-bit continuation of fp32 state differs by {diff}"
    );

    let err = AdamW::new(1, cfg)
        .load_state(1, &state)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("exp_avg.0") && err.contains("adamw8bit"),
        "{err}"
    );
    Ok(())
}

/// `--optim adamw8bit` with a GPU and the state beside the model is refused at validation.
#[test]
fn eight_bit_on_a_gpu_needs_the_state_on_the_host() -> anyhow::Result<()> {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        common: ft_trainer::train::CommonArgs,
    }
    let parse = |extra: &[&str]| {
        let mut v = vec!["t", "--optim", "adamw8bit"];
        v.extend(extra);
        Cli::parse_from(v)
            .common
            .validate()
            .err()
            .map(|e| e.to_string())
    };
    let err = parse(&["--device", "cuda"]).unwrap_or_default();
    assert!(err.contains("--offload-optimizer"), "{err}");
    assert!(parse(&["--device", "cuda", "--offload-optimizer"]).is_none());
    assert!(parse(&["--device", "cpu"]).is_none());
    let bad = Cli::parse_from(["t", "--optim", "lion"]).common.validate();
    assert!(bad
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
        .contains("--optim"));
    Ok(())
}

/// A tensor large enough to be split over threads (here 200,000 values) updates exactly as its
/// 256-aligned pieces do, each small enough for one thread: the blocks are independent and the
/// threaded partition loses or shifts none of them.
#[test]
fn threaded_blocks_equal_the_pieces_updated_alone() -> anyhow::Result<()> {
    let cfg = AdamWConfig::default();
    let n = 200_000;
    let piece = 196 * 256; // 50,176: under the 65,536 values one thread takes
    let bounds: Vec<(usize, usize)> = (0..n)
        .step_by(piece)
        .map(|a| (a, piece.min(n - a)))
        .collect();
    let w0 = randn(&[n], 1, 1.0)?;
    let whole = Var::from_tensor(&w0)?;
    let pieces: Vec<Var> = bounds
        .iter()
        .map(|(a, l)| Ok(Var::from_tensor(&w0.narrow(0, *a, *l)?)?))
        .collect::<anyhow::Result<_>>()?;
    let mut a = AdamW8bit::new(1, cfg);
    let mut b = AdamW8bit::new(pieces.len(), cfg);
    for step in 0..3 {
        let g = randn(&[n], 10 + step, 1.0)?;
        a.step(std::slice::from_ref(&whole), &[Some(g.clone())], 1e-3)?;
        let gs: Vec<Option<Tensor>> = bounds
            .iter()
            .map(|(s, l)| Ok(Some(g.narrow(0, *s, *l)?)))
            .collect::<anyhow::Result<_>>()?;
        b.step(&pieces, &gs, 1e-3)?;
    }
    let joined = Tensor::cat(&pieces.iter().map(|p| p.as_tensor()).collect::<Vec<_>>(), 0)?;
    assert_eq!(bits(whole.as_tensor())?, bits(&joined)?);
    Ok(())
}

/// An inf gradient spoils its own weight (as in fp32 AdamW) but not the other 255 of its block:
/// the block maximum is taken over finite moments.
#[test]
fn an_inf_gradient_stays_in_its_element() -> anyhow::Result<()> {
    let w = Var::from_tensor(&randn(&[5000], 1, 1.0)?)?;
    let mut opt = AdamW8bit::new(1, AdamWConfig::default());
    for step in 0..3u64 {
        let mut g = randn(&[5000], 10 + step, 1.0)?.to_vec1::<f32>()?;
        if step == 1 {
            g[7] = f32::INFINITY;
        }
        let g = Tensor::from_vec(g, 5000, &Device::Cpu)?;
        opt.step(std::slice::from_ref(&w), &[Some(g)], 1e-3)?;
        if step == 1 {
            // Both inf moments are stored as their map's top value, not its neighbour.
            let (_, state) = opt.state();
            for name in ["exp_avg.0", "exp_avg_sq.0"] {
                let codes = state.iter().find(|(n, _)| n == name).expect(name);
                assert_eq!(codes.1.get(7)?.to_scalar::<u8>()?, 255, "{name}");
            }
        }
    }
    let v = w.as_tensor().to_vec1::<f32>()?;
    let bad: Vec<usize> = (0..v.len()).filter(|i| !v[*i].is_finite()).collect();
    assert!(bad.iter().all(|i| *i == 7), "non-finite weights at {bad:?}");
    Ok(())
}

/// A small (fp32-moment) parameter refuses restored 8-bit or mis-sized moments by name.
#[test]
fn small_parameters_check_what_they_restore() -> anyhow::Result<()> {
    let w = Var::from_tensor(&randn(&[100], 1, 1.0)?)?;
    let g = || -> anyhow::Result<Vec<Option<Tensor>>> { Ok(vec![Some(randn(&[100], 2, 1.0)?)]) };
    for (m, v) in [
        (
            Tensor::zeros(100, DType::U8, &Device::Cpu)?,
            Tensor::zeros(100, DType::F32, &Device::Cpu)?,
        ),
        (
            Tensor::zeros(99, DType::F32, &Device::Cpu)?,
            Tensor::zeros(99, DType::F32, &Device::Cpu)?,
        ),
    ] {
        let mut opt = AdamW8bit::new(1, AdamWConfig::default());
        opt.load_state(1, &[("exp_avg.0".into(), m), ("exp_avg_sq.0".into(), v)])?;
        let err = opt.step(std::slice::from_ref(&w), &g()?, 1e-3).err();
        let err = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("parameter 0"), "{err}");
    }
    Ok(())
}
