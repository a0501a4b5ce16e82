//! Pooling: values against a naive loop (odd sizes, kernel != stride) and gradients against
//! finite differences (candle scales max-pool gradients by 1/k^2 and errors for kernel != stride).

mod common;
use candle_core::{DType, Device, Result, Tensor};
use common::*;
use ft_kernels::pool::{avg_pool2d, global_avg_pool, max_pool2d};

fn naive(x: &Tensor, k: (usize, usize), s: (usize, usize), max: bool) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    let (oh, ow) = ((h - k.0) / s.0 + 1, (w - k.1) / s.1 + 1);
    let v: Vec<f64> = x.flatten_all()?.to_vec1()?;
    let mut out = Vec::new();
    for p in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                let win: Vec<f64> = (0..k.0)
                    .flat_map(|dy| (0..k.1).map(move |dx| (dy, dx)))
                    .map(|(dy, dx)| v[p * h * w + (oy * s.0 + dy) * w + ox * s.1 + dx])
                    .collect();
                out.push(if max {
                    win.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
                } else {
                    win.iter().sum::<f64>() / win.len() as f64
                });
            }
        }
    }
    Tensor::from_vec(out, (n, c, oh, ow), &Device::Cpu)
}

const CASES: [((usize, usize), (usize, usize)); 4] = [
    ((2, 2), (2, 2)),
    ((3, 3), (2, 2)),
    ((3, 2), (1, 2)),
    ((2, 2), (3, 3)),
];

#[test]
fn values_match_naive_on_odd_sizes() -> Result<()> {
    let x = rand(&[2, 3, 7, 5], 1)?;
    for (k, s) in CASES {
        assert_eq!(
            max_diff(&max_pool2d(&x, k, s)?, &naive(&x, k, s, true)?)?,
            0.0,
            "max {k:?} {s:?}"
        );
        assert!(
            max_diff(&avg_pool2d(&x, k, s)?, &naive(&x, k, s, false)?)? < 1e-15,
            "avg {k:?} {s:?}"
        );
    }
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    // Distinct values (no ties) so max pooling is differentiable at the test point.
    let x = rand(&[2, 2, 7, 5], 2)?;
    for (k, s) in CASES {
        check_gradients(|xs| max_pool2d(&xs[0], k, s), std::slice::from_ref(&x), EPS)?
            .assert_close(TOL)?;
        check_gradients(|xs| avg_pool2d(&xs[0], k, s), std::slice::from_ref(&x), EPS)?
            .assert_close(TOL)?;
    }
    check_gradients(|xs| global_avg_pool(&xs[0]), std::slice::from_ref(&x), EPS)?
        .assert_close(TOL)?;
    // Non-contiguous input and an input with another consumer.
    check_gradients(
        |xs| max_pool2d(&xs[0].transpose(2, 3)?, (2, 2), (2, 2)),
        std::slice::from_ref(&x),
        EPS,
    )?
    .assert_close(TOL)?;
    check_gradients(
        |xs| avg_pool2d(&xs[0], (2, 2), (2, 2))?.sum_all()? + xs[0].sqr()?.sum_all()?,
        &[x],
        EPS,
    )?
    .assert_close(TOL)
}

#[test]
fn max_gradient_goes_to_the_first_maximum_unscaled() -> Result<()> {
    let dev = Device::Cpu;
    // One [1, 1, 2, 4] plane, two 2x2 windows: outputs and input gradients of (y * [10, 20]),
    // through the 2x2/2 path and through the general loop (stride (1, 2) gives the same
    // windows), which must agree.
    let run = |row0: [f64; 4], row1: [f64; 4]| -> Result<(Vec<f64>, Vec<f64>)> {
        let x = Tensor::new(&[[[row0, row1]]], &dev)?;
        let w = Tensor::new(&[[[[10f64, 20.]]]], &dev)?;
        let mut got = Vec::new();
        for stride in [(2, 2), (1, 2)] {
            let (y, g) = pass(&x, &w, DType::F64, true, (2, 2), stride)?;
            let (y, g): (Vec<f64>, Vec<f64>) =
                (y.flatten_all()?.to_vec1()?, g.flatten_all()?.to_vec1()?);
            got.push((y, g));
        }
        let (fast, general) = (&got[0], &got[1]);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast.0), bits(&general.0), "outputs of the two paths");
        assert_eq!(fast.1, general.1, "gradients of the two paths");
        Ok(got.swap_remove(0))
    };
    // Ties: the first maximum takes the whole gradient, unscaled.
    let (_, g) = run([1., 3., 3., 0.], [2., 0., 1., 1.])?;
    assert_eq!(g, vec![0., 10., 20., 0., 0., 0., 0., 0.]);
    // A window of -inf (a masked map) sends its gradient to its own first element, not the
    // plane's.
    let ninf = f64::NEG_INFINITY;
    let (_, g) = run([1., 2., ninf, ninf], [0., 0., ninf, ninf])?;
    assert_eq!(g, vec![0., 10., 20., 0., 0., 0., 0., 0.]);
    // NaN propagates: the first NaN of the window is the output and gets the gradient.
    let nan = f64::NAN;
    let (y, g) = run([1., nan, 5., 6.], [3., nan, 7., 8.])?;
    assert!(y[0].is_nan() && y[1] == 8.);
    assert_eq!(g, vec![0., 10., 0., 0., 0., 0., 0., 20.]);
    let x = Tensor::new(&[[[[1f64, 3., 3., 0.], [2., 0., 1., 1.]]]], &dev)?;
    assert!(
        max_pool2d(&x, (3, 3), (1, 1)).is_err(),
        "kernel larger than the input"
    );
    Ok(())
}

/// Ties (small integers, as a ReLU's zeros make them) and NaNs on a 9 x 11 plane: each window's
/// gradient goes to its first maximum in row-major order (the first NaN where there is one),
/// against a plain loop, for the 2x2 stride-2 path and the row-at-a-time loop at column stride 2
/// (3x3 stride 2, the ResNet stem's, and 3x2 stride 1x2) and at other strides (2x3 stride 1, 2x2
/// stride 3).
#[test]
fn ties_and_nans_go_to_the_first_maximum_on_every_path() -> Result<()> {
    let dev = Device::Cpu;
    let (h, w) = (9usize, 11usize);
    let mut v: Vec<f64> = (0..h * w).map(|i| ((i * 7 + i / 5) % 4) as f64).collect();
    for at in [12, 40, 41, 77] {
        v[at] = f64::NAN;
    }
    let x = Tensor::from_vec(v.clone(), (1, 1, h, w), &dev)?;
    for (k, s) in [
        ((2, 2), (2, 2)),
        ((3, 3), (2, 2)),
        ((3, 2), (1, 2)),
        ((2, 3), (1, 1)),
        ((2, 2), (3, 3)),
    ] {
        let (oh, ow) = ((h - k.0) / s.0 + 1, (w - k.1) / s.1 + 1);
        let weights: Vec<f64> = (0..oh * ow).map(|i| (i + 1) as f64).collect();
        let wt = Tensor::from_vec(weights.clone(), (1, 1, oh, ow), &dev)?;
        let (_, g) = pass(&x, &wt, DType::F64, true, k, s)?;
        let mut want = vec![0f64; h * w];
        for oy in 0..oh {
            for ox in 0..ow {
                let mut best: Option<usize> = None;
                for dy in 0..k.0 {
                    for dx in 0..k.1 {
                        let at = (oy * s.0 + dy) * w + ox * s.1 + dx;
                        let take = match best {
                            None => true,
                            Some(b) => (v[at] > v[b]) || (v[at].is_nan() && !v[b].is_nan()),
                        };
                        if take {
                            best = Some(at);
                        }
                    }
                }
                if let Some(b) = best {
                    want[b] += weights[oy * ow + ox];
                }
            }
        }
        let got: Vec<f64> = g.flatten_all()?.to_vec1()?;
        assert_eq!(got, want, "kernel {k:?} stride {s:?}");
    }
    Ok(())
}

/// Forward and gradient of `(pool(x) * w).sum()` for `x` and `w` in `dtype`.
fn pass(
    x: &Tensor,
    w: &Tensor,
    dtype: DType,
    max: bool,
    k: (usize, usize),
    s: (usize, usize),
) -> Result<(Tensor, Tensor)> {
    let v = candle_core::Var::from_tensor(&x.to_dtype(dtype)?)?;
    let y = if max {
        max_pool2d(v.as_tensor(), k, s)?
    } else {
        avg_pool2d(v.as_tensor(), k, s)?
    };
    let grads = (&y * w.to_dtype(dtype)?)?.sum_all()?.backward()?;
    let g = grads.get(v.as_tensor()).cloned().expect("gradient");
    Ok((y, g))
}

#[test]
fn every_dtype_gets_the_f64_result_rounded_once() -> Result<()> {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // Values representable in `dtype`, so the f64 pass sees the same input.
        let x = rand(&[3, 4, 9, 7], 3)?
            .to_dtype(dtype)?
            .to_dtype(DType::F64)?;
        for (k, s) in CASES {
            let (oh, ow) = ((9 - k.0) / s.0 + 1, (7 - k.1) / s.1 + 1);
            let w = rand(&[3, 4, oh, ow], 4)?
                .to_dtype(dtype)?
                .to_dtype(DType::F64)?;
            for max in [true, false] {
                let (y, g) = pass(&x, &w, dtype, max, k, s)?;
                let (y64, g64) = pass(&x, &w, DType::F64, max, k, s)?;
                let what = format!("{dtype:?} max={max} {k:?} {s:?}");
                assert_eq!(max_diff(&y, &y64.to_dtype(dtype)?)?, 0.0, "forward {what}");
                assert_eq!(max_diff(&g, &g64.to_dtype(dtype)?)?, 0.0, "gradient {what}");
            }
        }
    }
    Ok(())
}
