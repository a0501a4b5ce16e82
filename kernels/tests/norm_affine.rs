//! The normalisation with its affine part and activation as one op (`norm::layer_norm`,
//! `rms_norm`, `group_norm`, `group_norm_act` with a weight): gradients against finite
//! differences; the forward equal to the separate ops bit for bit in every float dtype; the
//! gradients as close to the f64 truth as the separate ops' are; the parameters' gradients the
//! same bits on any number of threads; bad shapes refused.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use common::*;
use ft_kernels::activation::{activate, Activation};
use ft_kernels::norm::{group_norm, group_norm_act, layer_norm, rms_norm};

/// Which norm: over the last dimension (centred: layer norm; not: RMS norm) or in groups.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Layer,
    Rms,
    Group(usize),
}

/// A case: the kind, the bias's presence, the activation after it (group norm only).
#[derive(Clone, Copy, Debug)]
struct Case {
    kind: Kind,
    bias: bool,
    act: Option<Activation>,
}

const EPS_NORM: f64 = 1e-5;

/// These tests compare the op with the separate ops: under `FT_NORM_OP=0` both sides would be
/// the separate ops and every comparison would pass, so they refuse to run there.
fn the_op_is_on() {
    assert!(
        std::env::var("FT_NORM_OP").as_deref() != Ok("0"),
        "FT_NORM_OP=0 turns off the op these tests check"
    );
}

/// The op under test.
fn fused(c: Case, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    the_op_is_on();
    match (c.kind, c.act) {
        (Kind::Layer, _) => layer_norm(x, Some(w), b, EPS_NORM),
        (Kind::Rms, _) => rms_norm(x, Some(w), EPS_NORM),
        (Kind::Group(g), None) => group_norm(x, g, Some(w), b, EPS_NORM),
        (Kind::Group(g), Some(a)) => group_norm_act(x, g, Some(w), b, EPS_NORM, a),
    }
}

/// The separate ops it replaces: the normalisation alone (no weight: not fused), a broadcast
/// multiply, a broadcast add, the activation.
fn separate(c: Case, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (y, shape) = match c.kind {
        Kind::Layer => (layer_norm(x, None, None, EPS_NORM)?, vec![w.dim(0)?]),
        Kind::Rms => (rms_norm(x, None, EPS_NORM)?, vec![w.dim(0)?]),
        Kind::Group(g) => {
            let mut s = vec![1; x.rank()];
            s[1] = w.dim(0)?;
            (group_norm(x, g, None, None, EPS_NORM)?, s)
        }
    };
    let mut y = y.broadcast_mul(&w.reshape(shape.as_slice())?)?;
    if let Some(b) = b {
        y = y.broadcast_add(&b.reshape(shape.as_slice())?)?;
    }
    match c.act {
        Some(a) => activate(&y, a),
        None => Ok(y),
    }
}

fn cases() -> Vec<(Case, Vec<usize>)> {
    let mut v = vec![
        (
            Case {
                kind: Kind::Layer,
                bias: true,
                act: None,
            },
            vec![3, 4, 9],
        ),
        (
            Case {
                kind: Kind::Layer,
                bias: false,
                act: None,
            },
            vec![5, 6],
        ),
        (
            Case {
                kind: Kind::Rms,
                bias: false,
                act: None,
            },
            vec![2, 3, 8],
        ),
    ];
    for bias in [true, false] {
        for act in [
            None,
            Some(Activation::Silu),
            Some(Activation::GeluErf),
            Some(Activation::GeluTanh),
            Some(Activation::Relu),
        ] {
            let kind = Kind::Group(3);
            v.push((Case { kind, bias, act }, vec![2, 6, 3, 5]));
        }
    }
    v
}

/// The output and the gradients (of `sum(y * probe)`) of x, w and b, as f64.
fn run(
    c: Case,
    inputs: &[Tensor],
    probe: &Tensor,
    f: fn(Case, &Tensor, &Tensor, Option<&Tensor>) -> Result<Tensor>,
) -> Result<Vec<Vec<f64>>> {
    let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(c, &ts[0], &ts[1], ts.get(2))?;
    let of: Vec<&Tensor> = ts.iter().collect();
    let grads = probed_gradients(&y, &probe.to_dtype(y.dtype())?, &of)?;
    std::iter::once(y)
        .chain(grads)
        .map(|t| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>())
        .collect()
}

/// Random x (scaled and shifted so that the statistics matter), weight and bias for a case.
fn inputs(c: Case, shape: &[usize], seed: u64) -> Result<Vec<Tensor>> {
    let ch = match c.kind {
        Kind::Group(_) => shape[1],
        _ => shape[shape.len() - 1],
    };
    let x = ((rand(shape, seed)? * 3.0)? + 0.5)?;
    let mut v = vec![x, (rand(&[ch], seed + 1)? + 1.0)?];
    if c.bias {
        v.push(rand(&[ch], seed + 2)?);
    }
    Ok(v)
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    for (i, (c, shape)) in cases().into_iter().enumerate() {
        let xs = inputs(c, &shape, 10 * i as u64)?;
        check_gradients(|t| fused(c, &t[0], &t[1], t.get(2)), &xs, EPS)?
            .assert_close(TOL)
            .map_err(|e| candle_core::Error::Msg(format!("{c:?}: {e}")))?;
    }
    Ok(())
}

/// The largest difference from `truth` relative to its largest magnitude.
fn err(got: &[f64], truth: &[f64]) -> f64 {
    let scale = truth.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    let d = got
        .iter()
        .zip(truth)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    d / scale
}

/// On `shape`, each dtype: the output equal to the separate ops' bit for bit, and each
/// gradient at most as far from the f64 truth as the separate ops' (plus one unit of the
/// dtype's rounding, as the two round at different places).
fn against_the_separate_ops(c: Case, shape: &[usize], seed: u64) -> Result<()> {
    let xs = inputs(c, shape, seed)?;
    let probe = Tensor::rand(-1f32, 1f32, shape, &Device::Cpu)?;
    let truth = run(c, &xs, &probe, separate)?;
    for (dtype, ulp) in [
        (DType::F32, f32::EPSILON as f64),
        (DType::BF16, 1.0 / 128.0),
        (DType::F16, 1.0 / 1024.0),
        // f64 is the truth's own dtype: the separate ops' error is 0 there, so the slack
        // stands for the sums' order (the op sums the parameters' gradients per task).
        (DType::F64, 1e-14),
    ] {
        let xs: Vec<Tensor> = xs
            .iter()
            .map(|t| t.to_dtype(dtype))
            .collect::<Result<_>>()?;
        let ours = run(c, &xs, &probe, fused)?;
        let theirs = run(c, &xs, &probe, separate)?;
        assert!(ours[0] == theirs[0], "{c:?} {dtype:?} {shape:?}: forward");
        for k in 1..ours.len() {
            let (e_ours, e_theirs) = (err(&ours[k], &truth[k]), err(&theirs[k], &truth[k]));
            assert!(
                e_ours <= 2.0 * e_theirs + 2.0 * ulp,
                "{c:?} {dtype:?} {shape:?}: gradient {k}: {e_ours:e} against {e_theirs:e}"
            );
        }
    }
    Ok(())
}

#[test]
fn the_forward_is_the_separate_ops_bit_for_bit_and_the_gradients_as_close() -> Result<()> {
    for (i, (c, shape)) in cases().into_iter().enumerate() {
        against_the_separate_ops(c, &shape, 100 + i as u64)?;
    }
    Ok(())
}

#[test]
fn many_rows_take_several_tasks_with_the_same_results() -> Result<()> {
    let chunk = ft_kernels::host::CHUNK;
    let layer = Case {
        kind: Kind::Layer,
        bias: true,
        act: None,
    };
    // Rows that do not divide a task, more than two tasks.
    against_the_separate_ops(layer, &[2 * chunk / 500 + 7, 500], 1)?;
    let rms = Case {
        kind: Kind::Rms,
        bias: false,
        act: None,
    };
    against_the_separate_ops(rms, &[3, chunk + 5], 2)?;
    let group = Case {
        kind: Kind::Group(4),
        bias: true,
        act: Some(Activation::Silu),
    };
    against_the_separate_ops(group, &[5, 8, 40, 60], 3)
}

#[test]
fn the_parameters_gradients_do_not_depend_on_the_threads() -> Result<()> {
    let c = Case {
        kind: Kind::Group(2),
        bias: true,
        act: Some(Activation::Silu),
    };
    let shape = [9, 4, 64, 70];
    let xs: Vec<Tensor> = inputs(c, &shape, 7)?
        .iter()
        .map(|t| t.to_dtype(DType::F32))
        .collect::<Result<_>>()?;
    let probe = Tensor::rand(-1f32, 1f32, &shape[..], &Device::Cpu)?;
    let on = |threads: usize| -> Result<Vec<Vec<f64>>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        pool.install(|| run(c, &xs, &probe, fused))
    };
    let one = on(1)?;
    for threads in [2, 3] {
        assert!(on(threads)? == one, "{threads} threads");
    }
    Ok(())
}

#[test]
fn bad_shapes_are_refused_and_empty_inputs_pass() -> Result<()> {
    let msg = |r: Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let x = rand(&[2, 6, 3, 3], 1)?;
    let e = msg(group_norm(&x, 4, Some(&rand(&[6], 2)?), None, 1e-5));
    assert!(e.contains("4 groups") && e.contains("[2, 6, 3, 3]"), "{e}");
    let e = msg(group_norm(&x, 3, Some(&rand(&[5], 2)?), None, 1e-5));
    assert!(e.contains("[5]") && e.contains("6 channels"), "{e}");
    let e = msg(layer_norm(
        &rand(&[3, 7], 1)?,
        Some(&rand(&[6], 2)?),
        None,
        1e-5,
    ));
    assert!(e.contains("[6]") && e.contains("7 channels"), "{e}");
    // No rows, or rows of nothing: empty outputs and gradients.
    for shape in [[0usize, 6, 2, 2], [2, 6, 0, 0]] {
        let x = Var::from_tensor(&rand(&shape, 3)?)?;
        let w = Var::from_tensor(&rand(&[6], 4)?)?;
        let y = group_norm_act(
            x.as_tensor(),
            3,
            Some(w.as_tensor()),
            None,
            1e-5,
            Activation::Silu,
        )?;
        assert_eq!(y.dims(), shape);
        let g = y.sum_all()?.backward()?;
        assert_eq!(
            g.get(x.as_tensor()).map(|t| t.dims().to_vec()),
            Some(shape.to_vec())
        );
        let gw = g
            .get(w.as_tensor())
            .map(|t| t.to_vec1::<f64>())
            .transpose()?;
        assert_eq!(gw, Some(vec![0.0; 6]));
    }
    Ok(())
}
