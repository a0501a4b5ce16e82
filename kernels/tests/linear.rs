//! Matmul and linear: the case candle computes wrongly (transposed lhs x broadcast rhs, batch > 1)
//! against a naive triple loop, and gradients against finite differences.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use common::*;
use ft_kernels::linear::{is_one_op, linear, matmul};

/// Naive [.., m, k] x [.., k, n] over equal batch dims, on flattened data.
fn naive(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (bs, m, k) = a.dims3()?;
    let n = b.dim(2)?;
    let av: Vec<f64> = a.flatten_all()?.to_vec1()?;
    let bv: Vec<f64> = b.flatten_all()?.to_vec1()?;
    let mut out = vec![0f64; bs * m * n];
    for z in 0..bs {
        for i in 0..m {
            for j in 0..n {
                out[(z * m + i) * n + j] = (0..k)
                    .map(|t| av[(z * m + i) * k + t] * bv[(z * k + t) * n + j])
                    .sum();
            }
        }
    }
    Tensor::from_vec(out, (bs, m, n), &Device::Cpu)
}

#[test]
fn transposed_lhs_times_broadcast_rhs_is_right() -> Result<()> {
    // lhs: a transposed view [3, 4, 5]; rhs: [5, 6] broadcast to [3, 5, 6] (stride 0).
    let a = random_non_contiguous(&[3, 4, 5], 1, &Device::Cpu)?;
    assert!(!a.is_contiguous());
    let b = rand(&[5, 6], 2)?;
    let got = matmul(&a, &b.unsqueeze(0)?)?;
    let want = naive(
        &a.contiguous()?,
        &b.unsqueeze(0)?.broadcast_as((3, 5, 6))?.contiguous()?,
    )?;
    assert!(max_diff(&got, &want)? < 1e-12);
    // linear on a non-contiguous 3-D input: what nn::Linear gets wrong.
    let w = rand(&[6, 5], 3)?;
    let bias = rand(&[6], 4)?;
    let x = rand(&[3, 5, 4], 5)?.transpose(1, 2)?; // [3, 4, 5]
    let got = linear(&x, &w, Some(&bias))?;
    let want = naive(
        &x.contiguous()?,
        &w.t()?.unsqueeze(0)?.broadcast_as((3, 5, 6))?.contiguous()?,
    )?
    .broadcast_add(&bias)?;
    assert!(max_diff(&got, &want)? < 1e-12);
    Ok(())
}

#[test]
fn four_d_non_contiguous_rhs_works() -> Result<()> {
    let a = rand(&[2, 3, 4, 5], 6)?;
    let b = rand(&[2, 3, 6, 5], 7)?.transpose(2, 3)?;
    let got = matmul(&a, &b)?;
    let want = naive(&a.reshape((6, 4, 5))?, &b.contiguous()?.reshape((6, 5, 6))?)?
        .reshape((2, 3, 4, 6))?;
    assert!(max_diff(&got, &want)? < 1e-12);
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    let (a, b) = (rand(&[2, 3, 5], 8)?, rand(&[5, 4], 9)?);
    check_gradients(
        |xs| matmul(&xs[0].transpose(1, 2)?.transpose(1, 2)?, &xs[1]),
        &[a.clone(), b],
        EPS,
    )?
    .assert_close(TOL)?;
    let (w, bias) = (rand(&[4, 3], 10)?, rand(&[4], 11)?);
    let x = rand(&[2, 3, 5], 12)?;
    check_gradients(
        |xs| linear(&xs[0].transpose(1, 2)?, &xs[1], Some(&xs[2])),
        &[x, w, bias],
        EPS,
    )?
    .assert_close(TOL)?;
    let _ = a;
    Ok(())
}

/// `x W^T (+ b)` through candle's own ops: the reference the one-op layer is held to.
fn candle_ops(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let d = x.dims().to_vec();
    let rows = x.elem_count() / d[d.len() - 1];
    let y = x.reshape((rows, d[d.len() - 1]))?.matmul(&w.t()?)?;
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out = d;
    *out.last_mut().unwrap() = w.dim(0)?;
    y.reshape(out)
}

/// The op against candle's matmul and bias add: the output and the input and weight gradients
/// the same bits (gemm sums each value in the same order, however the output is cut), the bias
/// gradient (summed in f64 here, in f32 by candle) within rounding; f32 and f64; 3-D and 2-D
/// inputs, shapes large enough to be cut into blocks and too small to be, weights the forward
/// copies into spread rows (`din` an even number of cache lines, 64 rows or more: 128, 96 and
/// 512 in f32, those and 48 in f64) and weights it reads in place; with and without a bias.
#[test]
fn the_op_is_candles_matmul_and_bias_add() -> Result<()> {
    assert!(
        std::env::var("FT_LINEAR_OP").as_deref() != Ok("0"),
        "FT_LINEAR_OP=0 turns off the op this test checks"
    );
    for (i, (xs, dout)) in [
        (vec![2usize, 300, 128], 160usize),
        (vec![4, 250, 96], 192),
        (vec![700, 48], 40),
        (vec![3, 5], 7),
        (vec![1, 1, 130], 257),
        (vec![2, 40, 512], 96),
    ]
    .into_iter()
    .enumerate()
    {
        for dtype in [DType::F32, DType::F64] {
            for with_bias in [false, true] {
                let seed = 10 * i as u64;
                let din = xs[xs.len() - 1];
                let var = |t: Tensor| Var::from_tensor(&t.to_dtype(dtype)?);
                let x = var(rand(&xs, seed)?)?;
                let w = var(rand(&[dout, din], seed + 1)?)?;
                let b = var(rand(&[dout], seed + 2)?)?;
                let b = with_bias.then_some(b.as_tensor());
                assert!(is_one_op(&x, &w, b));
                let mut out_dims = xs.clone();
                *out_dims.last_mut().unwrap() = dout;
                let probe = rand(&out_dims, seed + 3)?.to_dtype(dtype)?;
                let ours = linear(&x, &w, b)?;
                let want = candle_ops(&x, &w, b)?;
                assert!(same_bits(&ours, &want)?, "{xs:?} x {dout} {dtype:?} output");
                let mut of = vec![x.as_tensor(), w.as_tensor()];
                of.extend(b);
                let g = probed_gradients(&ours, &probe, &of)?;
                let h = probed_gradients(&want, &probe, &of)?;
                assert!(same_bits(&g[0], &h[0])?, "{xs:?} {dtype:?} input gradient");
                assert!(same_bits(&g[1], &h[1])?, "{xs:?} {dtype:?} weight gradient");
                if with_bias {
                    let tol = if dtype == DType::F32 { 1e-5 } else { 1e-13 };
                    assert!(
                        rel_diff(&g[2], &h[2])? < tol,
                        "{xs:?} {dtype:?} bias gradient"
                    );
                }
            }
        }
    }
    Ok(())
}

/// An input outside the graph (an input tensor, a frozen weight or bias) gets no gradient (its
/// product or sum is skipped), and the others' are the same as with every input in the graph.
#[test]
fn an_input_outside_the_graph_gets_no_gradient() -> Result<()> {
    let x = rand(&[40, 33], 1)?.to_dtype(DType::F32)?;
    let w = rand(&[20, 33], 2)?.to_dtype(DType::F32)?;
    let b = rand(&[20], 3)?.to_dtype(DType::F32)?;
    let (xv, wv, bv) = (
        Var::from_tensor(&x)?,
        Var::from_tensor(&w)?,
        Var::from_tensor(&b)?,
    );
    let loss = |x: &Tensor, w: &Tensor, b: &Tensor| linear(x, w, Some(b))?.sqr()?.sum_all();
    let all = loss(&xv, &wv, &bv)?.backward()?;
    let no_x = loss(&x, &wv, &bv)?.backward()?;
    assert!(no_x.get(&x).is_none());
    assert!(same_bits(no_x.get(&wv).unwrap(), all.get(&wv).unwrap())?);
    assert!(same_bits(no_x.get(&bv).unwrap(), all.get(&bv).unwrap())?);
    let frozen = loss(&xv, &w, &b)?.backward()?;
    assert!(frozen.get(&w).is_none() && frozen.get(&b).is_none());
    assert!(same_bits(frozen.get(&xv).unwrap(), all.get(&xv).unwrap())?);
    Ok(())
}

/// Bad shapes are one error naming the op; bf16 takes candle's ops.
#[test]
fn bad_shapes_are_one_error_and_bf16_takes_candles_ops() -> Result<()> {
    let x = rand(&[4, 5], 1)?;
    let err = linear(&x, &rand(&[3, 6], 2)?, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("linear") || err.contains("shape"), "{err}");
    let err = linear(&x, &rand(&[3, 5], 2)?, Some(&rand(&[4], 3)?))
        .unwrap_err()
        .to_string();
    assert!(err.contains("linear") || err.contains("shape"), "{err}");
    let (xb, wb) = (
        x.to_dtype(DType::BF16)?,
        rand(&[3, 5], 2)?.to_dtype(DType::BF16)?,
    );
    assert!(!is_one_op(&xb, &wb, None));
    let y = linear(&xb, &wb, None)?;
    let want = candle_ops(&x, &rand(&[3, 5], 2)?, None)?;
    assert!(rel_diff(&y, &want)? < 2e-2);
    Ok(())
}

#[test]
fn gradients_without_a_bias_match_finite_differences() -> Result<()> {
    let (x, w) = (rand(&[3, 4, 6], 20)?, rand(&[5, 6], 21)?);
    check_gradients(|xs| linear(&xs[0], &xs[1], None), &[x, w], EPS)?.assert_close(TOL)
}
