//! conv2d (im2col + matmul, own backward): values against candle's conv2d forward and gradients
//! against finite differences for 1x1, 3x3, 5x5 and 7x7 kernels, strides 1 to 3, padding 0 to 3, odd
//! sizes, batch 2 and a strided input; f32/bf16 forwards within their tolerance of f64.

mod common;
use candle_core::{DType, Device, Result, Tensor};
use common::*;
use ft_kernels::conv::conv2d;

/// (kernel, stride, padding): with the ResNet stem's 7x7 stride-2 pad-3 and a 5x5 stride-3 pad-2, whose
/// taps reach past the image on both sides.
const CASES: [(usize, usize, usize); 7] = [
    (3, 1, 1),
    (3, 2, 1),
    (1, 1, 0),
    (3, 1, 0),
    (3, 2, 0),
    (7, 2, 3),
    (5, 3, 2),
];

#[test]
fn values_match_candle_forward() -> Result<()> {
    let dev = Device::Cpu;
    for (k, s, p) in CASES {
        let x = random_tensor(&[2, 3, 7, 6], 1, &dev)?;
        let w = random_tensor(&[5, 3, k, k], 2, &dev)?;
        let b = random_tensor(&[5], 3, &dev)?;
        let ours = conv2d(&x, &w, Some(&b), s, p)?;
        let want = x
            .conv2d(&w, p, s, 1, 1)?
            .broadcast_add(&b.reshape((1, 5, 1, 1))?)?;
        assert_eq!(ours.dims(), want.dims());
        let d = (ours - want)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(d < 1e-12, "k {k} s {s} p {p}: {d}");
    }
    Ok(())
}

/// Images narrower than the kernel's reach past the padding (1x1 under a 5x5 kernel with
/// padding 2, 2x3 under 7x7 with padding 3): some taps read only padding on a side.
#[test]
fn kernels_wider_than_the_image_read_padding() -> Result<()> {
    let dev = Device::Cpu;
    for (h, w, k, s, p) in [(1, 1, 5, 1, 2), (2, 3, 7, 1, 3), (2, 3, 7, 2, 3)] {
        let x = random_tensor(&[2, 3, h, w], 11, &dev)?;
        let wt = random_tensor(&[4, 3, k, k], 12, &dev)?;
        let ours = conv2d(&x, &wt, None, s, p)?;
        let want = x.conv2d(&wt, p, s, 1, 1)?;
        let d = (ours - want)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(d < 1e-12, "{h}x{w} k {k} s {s} p {p}: {d}");
        check_gradients(
            |t: &[Tensor]| conv2d(&t[0], &t[1], None, s, p),
            &[x, wt],
            1e-5,
        )?
        .assert_close(1e-6)?;
    }
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    let dev = Device::Cpu;
    for (k, s, p) in CASES {
        let x = random_tensor(&[2, 3, 5, 4], 4, &dev)?;
        let w = random_tensor(&[4, 3, k, k], 5, &dev)?;
        let b = random_tensor(&[4], 6, &dev)?;
        check_gradients(
            |t: &[Tensor]| conv2d(&t[0], &t[1], Some(&t[2]), s, p),
            &[x, w, b],
            1e-5,
        )?
        .assert_close(1e-6)?;
    }
    // A transposed (strided) input.
    let x = random_tensor(&[2, 3, 4, 5], 7, &dev)?;
    let w = random_tensor(&[2, 3, 3, 3], 8, &dev)?;
    check_gradients(
        |t: &[Tensor]| conv2d(&t[0].transpose(2, 3)?, &t[1], None, 1, 1),
        &[x, w],
        1e-5,
    )?
    .assert_close(1e-6)
}

#[test]
fn low_precision_forwards_stay_close() -> Result<()> {
    let dev = Device::Cpu;
    let x = random_tensor(&[1, 8, 6, 6], 9, &dev)?;
    let w = random_tensor(&[8, 8, 3, 3], 10, &dev)?;
    let exact = conv2d(&x, &w, None, 1, 1)?;
    let scale = exact.abs()?.max_all()?.to_scalar::<f64>()?;
    for (dt, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 2e-3)] {
        let y = conv2d(&x.to_dtype(dt)?, &w.to_dtype(dt)?, None, 1, 1)?;
        assert_eq!(y.dtype(), dt);
        let d = (y.to_dtype(DType::F64)? - &exact)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?;
        assert!(d / scale < tol, "{dt:?}: {}", d / scale);
    }
    Ok(())
}

/// The op against candle's conv2d (and broadcast add of the bias) in f64 on `x_shape` with an
/// [8 or 12, C, k, k] weight: values to 1e-11 and the input, weight and bias gradients of a random
/// probe to 1e-12 relative. Returns the variables, our output and our gradients for more checks.
#[allow(clippy::type_complexity)]
fn against_candle(
    x_shape: &[usize],
    o: usize,
    (k, s, p): (usize, usize, usize),
    bias: bool,
    seed: u64,
) -> Result<(
    [candle_core::Var; 3],
    Tensor,
    candle_core::backprop::GradStore,
)> {
    let dev = Device::Cpu;
    let x = candle_core::Var::from_tensor(&random_tensor(x_shape, seed, &dev)?)?;
    let w = candle_core::Var::from_tensor(&random_tensor(&[o, x_shape[1], k, k], seed + 1, &dev)?)?;
    let b = candle_core::Var::from_tensor(&random_tensor(&[o], seed + 2, &dev)?)?;
    let probe = |y: &Tensor| -> Result<Tensor> {
        let r = random_tensor(y.dims(), seed + 3, &dev)?;
        (y * r)?.sum_all()
    };
    let ours = conv2d(&x, &w, bias.then_some(b.as_tensor()), s, p)?;
    let mut want = x.conv2d(&w, p, s, 1, 1)?;
    if bias {
        want = want.broadcast_add(&b.reshape((1, o, 1, 1))?)?;
    }
    let what = format!("{x_shape:?} k {k} s {s} p {p} bias {bias}");
    assert!(max_diff(&ours, &want)? < 1e-11, "{what}");
    let (g1, g2) = (probe(&ours)?.backward()?, probe(&want)?.backward()?);
    let mut params = vec![("input", x.as_tensor()), ("weight", w.as_tensor())];
    if bias {
        params.push(("bias", b.as_tensor()));
    }
    for (name, t) in params {
        let (Some(a), Some(b)) = (g1.get(t), g2.get(t)) else {
            panic!("no {name} gradient ({what})")
        };
        assert!(rel_diff(a, b)? < 1e-12, "{what} {name}");
    }
    Ok(([x, w, b], ours, g1))
}

/// Images large enough that the unfolding and folding run on rayon's threads (one image's
/// columns over `PAR_ELEMS` for the 3x3 kernels; the 1x1 kernel's are under it, so its images
/// go on the threads one each), with a bias (added inside the op): values and the three gradients
/// against candle's conv2d and broadcast add and their backward in f64, and f32 within its
/// rounding of f64.
#[test]
fn large_images_match_candle_forward_and_backward() -> Result<()> {
    let dev = Device::Cpu;
    for (k, s, p) in [(3, 1, 1), (3, 2, 1), (1, 1, 0)] {
        let ([x, w, b], ours, g1) = against_candle(&[3, 16, 24, 22], 12, (k, s, p), true, 11)?;
        let probe = |y: &Tensor| -> Result<Tensor> {
            let r = random_tensor(y.dims(), 14, &dev)?;
            (y * r)?.sum_all()
        };
        // f32: the same products in f32, the folding summed in f64.
        let (x32, w32) = (
            candle_core::Var::from_tensor(&x.to_dtype(DType::F32)?)?,
            candle_core::Var::from_tensor(&w.to_dtype(DType::F32)?)?,
        );
        let b32 = b.to_dtype(DType::F32)?;
        let y32 = conv2d(&x32, &w32, Some(&b32), s, p)?;
        assert!(rel_diff(&y32, &ours)? < 1e-5);
        let g32 = probe(&y32.to_dtype(DType::F64)?)?.backward()?;
        for (t32, t) in [
            (x32.as_tensor(), x.as_tensor()),
            (w32.as_tensor(), w.as_tensor()),
        ] {
            let (Some(a), Some(b)) = (g32.get(t32), g1.get(t)) else {
                panic!("no f32 gradient")
            };
            assert!(rel_diff(a, b)? < 1e-5, "k {k} s {s} p {p} f32");
        }
    }
    Ok(())
}

/// The forward and the three gradients are the same bits on one thread as on three (f32 and
/// f64, with and without a bias), on every path: small images multiplied in groups (63 output
/// positions: five images a product, so batch 11 makes groups of 5, 5 and 1) and larger ones
/// (528 positions, one a product, unfolded on threads when alone; also at stride 2, and as an
/// input outside the graph) go on rayon's threads a group each when there are threads and
/// groups (each group's values as on one thread); a lone image is multiplied on gemm's
/// threads; the weight gradient is summed in parts fixed by the shape, groups in order.
#[test]
fn images_on_threads_give_the_bits_of_one_thread() -> Result<()> {
    let dev = Device::Cpu;
    // (shape, stride, whether the input is a variable: else it gets no gradient).
    let run = |(shape, s, track): ([usize; 4], usize, bool),
               dt: DType,
               bias: bool|
     -> Result<Vec<Vec<f64>>> {
        let x = candle_core::Var::from_tensor(&random_tensor(&shape, 21, &dev)?.to_dtype(dt)?)?;
        let w = candle_core::Var::from_tensor(
            &random_tensor(&[8, shape[1], 3, 3], 22, &dev)?.to_dtype(dt)?,
        )?;
        let b = candle_core::Var::from_tensor(&random_tensor(&[8], 23, &dev)?.to_dtype(dt)?)?;
        let input = if track {
            x.as_tensor().clone()
        } else {
            x.as_tensor().detach()
        };
        let y = conv2d(&input, &w, bias.then_some(b.as_tensor()), s, 1)?;
        let r = random_tensor(y.dims(), 24, &dev)?.to_dtype(dt)?;
        let g = (&y * r)?.sum_all()?.backward()?;
        let mut out = vec![y.flatten_all()?.to_dtype(DType::F64)?.to_vec1()?];
        for t in track
            .then_some(x.as_tensor())
            .into_iter()
            .chain([w.as_tensor()])
            .chain(bias.then_some(b.as_tensor()))
        {
            let Some(gt) = g.get(t) else {
                panic!("no gradient")
            };
            out.push(gt.flatten_all()?.to_dtype(DType::F64)?.to_vec1()?);
        }
        Ok(out)
    };
    let pool = |n: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
    };
    let (one, three) = (pool(1)?, pool(3)?);
    let cases = [
        ([11, 6, 9, 7], 1, true),
        ([3, 16, 24, 22], 1, true),
        ([3, 16, 24, 22], 2, true),
        ([3, 16, 24, 22], 1, false),
        ([1, 16, 24, 22], 1, true),
    ];
    for case in cases {
        for dt in [DType::F32, DType::F64] {
            for bias in [false, true] {
                let a = one.install(|| run(case, dt, bias))?;
                let b = three.install(|| run(case, dt, bias))?;
                for (i, (u, v)) in a.iter().zip(&b).enumerate() {
                    let same = u.iter().zip(v).all(|(p, q)| p.to_bits() == q.to_bits());
                    assert!(
                        same,
                        "{case:?} {dt:?} bias {bias}: output {i} differs between 1 and 3 threads"
                    );
                }
            }
        }
    }
    Ok(())
}

/// Images small enough to be multiplied in groups (the 3x3 and 1x1 kernels: 63 output positions,
/// groups of 5, 5 and 1 images; stride 2: 20 positions, all 11 images in one product), with and
/// without a bias: values and the three gradients against candle's conv2d in f64.
#[test]
fn grouped_images_match_candle_forward_and_backward() -> Result<()> {
    for (k, s, p) in [(3, 1, 1), (3, 2, 1), (1, 1, 0)] {
        for bias in [false, true] {
            against_candle(&[11, 6, 9, 7], 8, (k, s, p), bias, 31)?;
        }
    }
    Ok(())
}

/// A first layer's input (images, no graph) gets no gradient computed: the weight and bias
/// gradients are the same bits as when the input is a variable, for large, grouped and
/// threaded images.
#[test]
fn an_input_outside_the_graph_gets_no_gradient_and_changes_nothing() -> Result<()> {
    let dev = Device::Cpu;
    for (shape, k, s, p) in [
        ([3, 16, 24, 22], 3, 1, 1),
        ([11, 6, 9, 7], 3, 1, 1),
        ([11, 6, 9, 7], 3, 2, 1),
    ] {
        let xt = random_tensor(&shape, 41, &dev)?.to_dtype(DType::F32)?;
        let w = random_tensor(&[8, shape[1], k, k], 42, &dev)?.to_dtype(DType::F32)?;
        let b = random_tensor(&[8], 43, &dev)?.to_dtype(DType::F32)?;
        let grads = |track: bool| -> Result<(Vec<f32>, Vec<f32>, bool)> {
            let x = candle_core::Var::from_tensor(&xt)?;
            let (wv, bv) = (
                candle_core::Var::from_tensor(&w)?,
                candle_core::Var::from_tensor(&b)?,
            );
            let input = if track {
                x.as_tensor().clone()
            } else {
                xt.clone()
            };
            let y = conv2d(&input, &wv, Some(bv.as_tensor()), s, p)?;
            let r = random_tensor(y.dims(), 44, &dev)?.to_dtype(DType::F32)?;
            let g = (y * r)?.sum_all()?.backward()?;
            let flat = |t: &Tensor| -> Result<Vec<f32>> {
                g.get(t)
                    .ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?
                    .flatten_all()?
                    .to_vec1()
            };
            let has_dx = g.get(&input).is_some();
            Ok((flat(wv.as_tensor())?, flat(bv.as_tensor())?, has_dx))
        };
        let (dw, db, tracked_dx) = grads(true)?;
        let (dw2, db2, untracked_dx) = grads(false)?;
        assert!(tracked_dx && !untracked_dx, "{shape:?} s {s}");
        assert_eq!(dw, dw2, "{shape:?} s {s}: weight gradient");
        assert_eq!(db, db2, "{shape:?} s {s}: bias gradient");
    }
    Ok(())
}

/// A bias of each image's own ([B, O]: a UNet block's time embedding plus its convolution's
/// bias) is added in the op: the convolution plus a broadcast add, within rounding, on the
/// lone-image path (20 x 20 outputs), one group (5 images of 4 x 4) and several groups on
/// threads (20 images of 4 x 4: groups of 16 and 4); its gradient (each image's spatial sums)
/// and the others by finite differences; a bias for other images is one error, and a [1, O]
/// bias is a channel's for every image.
#[test]
fn a_bias_per_image_is_added_in_the_op() -> Result<()> {
    let dev = Device::Cpu;
    for (b, hw) in [(3usize, 20usize), (5, 4), (20, 4)] {
        let x = random_tensor(&[b, 3, hw, hw], 21, &dev)?;
        let w = random_tensor(&[4, 3, 3, 3], 22, &dev)?;
        let bias = random_tensor(&[b, 4], 23, &dev)?;
        let want = x
            .conv2d(&w, 1, 1, 1, 1)?
            .broadcast_add(&bias.unsqueeze(2)?.unsqueeze(3)?)?;
        let ours = conv2d(&x, &w, Some(&bias), 1, 1)?;
        let d = (ours - &want)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(d < 1e-12, "{b} images of {hw}x{hw}: {d}");
        let f32s = |t: &Tensor| t.to_dtype(DType::F32);
        let ours = conv2d(&f32s(&x)?, &f32s(&w)?, Some(&f32s(&bias)?), 1, 1)?;
        let d = (ours.to_dtype(DType::F64)? - &want)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?;
        assert!(d < 1e-5, "f32, {b} images of {hw}x{hw}: {d}");
        check_gradients(
            |t: &[Tensor]| conv2d(&t[0], &t[1], Some(&t[2]), 1, 1),
            &[x.clone(), w.clone(), bias],
            1e-5,
        )?
        .assert_close(1e-6)?;
        let other = random_tensor(&[b + 1, 4], 24, &dev)?;
        let err = conv2d(&x, &w, Some(&other), 1, 1).expect_err("a bias for other images");
        assert!(err.to_string().contains("bias"), "{err}");
        let one = random_tensor(&[1, 4], 25, &dev)?;
        let want = conv2d(&x, &w, Some(&one.flatten_all()?), 1, 1)?;
        let d = (conv2d(&x, &w, Some(&one), 1, 1)? - want)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?;
        assert_eq!(d, 0.0, "a [1, O] bias");
    }
    Ok(())
}
