//! Attention: the plain and the memory-efficient versions agree on values and gradients, both
//! match finite differences, masks broadcast, and the relative bias of `sdpa` gets a gradient.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use common::*;
use ft_kernels::attention::{sdpa, sdpa_memory_efficient, sdpa_query_chunks};

fn qkv(
    b: usize,
    h: usize,
    lq: usize,
    lk: usize,
    d: usize,
    seed: u64,
) -> Result<(Tensor, Tensor, Tensor)> {
    Ok((
        rand(&[b, h, lq, d], seed)?,
        rand(&[b, h, lk, d], seed + 1)?,
        rand(&[b, h, lk, d + 1], seed + 2)?,
    ))
}

fn masks(b: usize, h: usize, lq: usize, lk: usize) -> Result<Vec<Option<Tensor>>> {
    let dev = Device::Cpu;
    let pad: Vec<f64> = (0..b * lk)
        .map(|i| {
            if i % lk >= lk - 2 && i / lk == 0 {
                -1e9
            } else {
                0.
            }
        })
        .collect();
    let causal: Vec<f64> = (0..lq * lk)
        .map(|i| if i % lk > i / lk { -1e9 } else { 0. })
        .collect();
    Ok(vec![
        None,
        Some(Tensor::from_vec(pad, (b, 1, 1, lk), &dev)?),
        Some(Tensor::from_vec(causal, (1, 1, lq, lk), &dev)?),
        Some((rand(&[1, h, lq, lk], 9)? * 2.0)?),
    ])
}

/// `f` and `g` compute the same function of `inputs`: values and the gradient of every input
/// (of the output weighted by `w`) within `tol`.
fn assert_same_function(
    f: impl Fn(&[&Tensor]) -> Result<Tensor>,
    g: impl Fn(&[&Tensor]) -> Result<Tensor>,
    inputs: &[&Tensor],
    w: &Tensor,
    tol: f64,
    what: &str,
) -> Result<()> {
    let vars = inputs
        .iter()
        .map(|t| Var::from_tensor(t))
        .collect::<Result<Vec<_>>>()?;
    let x: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let run = |h: &dyn Fn(&[&Tensor]) -> Result<Tensor>| -> Result<(Tensor, Vec<Tensor>)> {
        let y = h(&x)?;
        let grads = (&y * w)?.sum_all()?.backward()?;
        let gs = x
            .iter()
            .map(|t| grads.get(t).cloned().expect("every input has a gradient"))
            .collect();
        Ok((y, gs))
    };
    let (y0, g0) = run(&f)?;
    let (y1, g1) = run(&g)?;
    assert!(max_diff(&y0, &y1)? < tol, "values, {what}");
    for (i, (a, c)) in g0.iter().zip(&g1).enumerate() {
        assert_eq!(a.dims(), c.dims(), "gradient {i}, {what}");
        assert!(max_diff(a, c)? < tol, "gradient {i}, {what}");
    }
    Ok(())
}

/// Values and gradients agree to 1e-6 in f64 (the memory-efficient op keeps its mask in f32).
#[test]
fn memory_efficient_equals_plain_in_values_and_gradients() -> Result<()> {
    for (b, h, lq, lk, d, chunk) in [(2, 3, 7, 7, 4, 3), (1, 2, 5, 9, 3, 4), (2, 1, 6, 6, 2, 16)] {
        let (q, k, v) = qkv(b, h, lq, lk, d, 1)?;
        let w = rand(&[b, h, lq, d + 1], 5)?;
        let scale = 1.0 / (d as f64).sqrt();
        for mask in masks(b, h, lq, lk)? {
            let m = mask.as_ref();
            assert_same_function(
                |x| sdpa(x[0], x[1], x[2], m, scale),
                |x| sdpa_memory_efficient(x[0], x[1], x[2], m, scale, chunk),
                &[&q, &k, &v],
                &w,
                1e-6,
                &format!("{b} {h} {lq} {lk} chunk {chunk}"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn both_match_finite_differences_on_strided_inputs() -> Result<()> {
    // q, k, v come from a [B, L, H, D] layout transposed to [B, H, L, D], as in a model.
    let (b, l, h, d) = (2, 5, 2, 3);
    let x = [
        rand(&[b, l, h, d], 1)?,
        rand(&[b, l, h, d], 2)?,
        rand(&[b, l, h, d], 3)?,
    ];
    let bias = rand(&[1, h, l, l], 4)?;
    let t = |t: &Tensor| t.transpose(1, 2);
    check_gradients(
        |xs| sdpa(&t(&xs[0])?, &t(&xs[1])?, &t(&xs[2])?, Some(&xs[3]), 0.5),
        &[x[0].clone(), x[1].clone(), x[2].clone(), bias.clone()],
        EPS,
    )?
    .assert_close(TOL)?;
    check_gradients(
        |xs| sdpa_memory_efficient(&t(&xs[0])?, &t(&xs[1])?, &t(&xs[2])?, Some(&bias), 0.5, 2),
        &x,
        EPS,
    )?
    .assert_close(TOL)
}

/// Query-chunked attention is the same function as `sdpa`: values and the gradients of q, k, v
/// and a trainable bias (with a query dimension, or broadcast over it, or rank 2), for chunks
/// of one row, of two rows and a last chunk shorter than the others.
#[test]
fn query_chunks_equal_plain_in_values_and_gradients() -> Result<()> {
    let (b, h, lq, lk, d) = (2, 3, 7, 5, 4);
    let (q, k, v) = qkv(b, h, lq, lk, d, 11)?;
    let w = rand(&[b, h, lq, d + 1], 14)?;
    let mut biases = masks(b, h, lq, lk)?;
    biases.push(Some(rand(&[lq, lk], 12)?));
    biases.push(Some(rand(&[b, 1, 1, lk], 13)?));
    for bias in biases {
        // The bias, when there is one, is an input too: its gradient is compared.
        let inputs: Vec<&Tensor> = [&q, &k, &v].into_iter().chain(bias.as_ref()).collect();
        for rows in [1, 2, 3] {
            let max_scores = b * h * lk * rows;
            assert_same_function(
                |x| sdpa(x[0], x[1], x[2], x.get(3).copied(), 0.5),
                |x| sdpa_query_chunks(x[0], x[1], x[2], x.get(3).copied(), 0.5, max_scores),
                &inputs,
                &w,
                1e-12,
                &format!("bias {:?}, {rows} rows", bias.as_ref().map(|t| t.dims())),
            )?;
        }
    }
    Ok(())
}

#[test]
fn query_chunks_match_finite_differences() -> Result<()> {
    let (b, h, l, d) = (1, 2, 5, 3);
    let x = [
        rand(&[b, h, l, d], 21)?,
        rand(&[b, h, l, d], 22)?,
        rand(&[b, h, l, d], 23)?,
        rand(&[1, h, l, l], 24)?,
    ];
    check_gradients(
        |xs| sdpa_query_chunks(&xs[0], &xs[1], &xs[2], Some(&xs[3]), 0.5, b * h * l * 2),
        &x,
        EPS,
    )?
    .assert_close(TOL)
}

#[test]
fn low_precision_forward_within_tolerance_of_f32() -> Result<()> {
    let (q, k, v) = qkv(1, 2, 8, 8, 4, 7)?;
    let f32_out = sdpa_memory_efficient(
        &q.to_dtype(DType::F32)?,
        &k.to_dtype(DType::F32)?,
        &v.to_dtype(DType::F32)?,
        None,
        0.5,
        3,
    )?;
    for (dt, tol) in [(DType::BF16, 2e-2), (DType::F16, 2e-3)] {
        let out = sdpa_memory_efficient(
            &q.to_dtype(dt)?,
            &k.to_dtype(dt)?,
            &v.to_dtype(dt)?,
            None,
            0.5,
            3,
        )?;
        assert_eq!(out.dtype(), dt);
        assert!(rel_diff(&out, &f32_out)? < tol, "{dt:?}");
        let plain = sdpa(
            &q.to_dtype(dt)?,
            &k.to_dtype(dt)?,
            &v.to_dtype(dt)?,
            None,
            0.5,
        )?;
        assert!(rel_diff(&plain, &f32_out)? < tol, "plain {dt:?}");
    }
    Ok(())
}

#[test]
fn bad_shapes_are_errors() -> Result<()> {
    let (q, k, v) = qkv(1, 2, 4, 4, 3, 1)?;
    assert!(sdpa_memory_efficient(&q, &k.narrow(3, 0, 2)?, &v, None, 1.0, 2).is_err());
    let bad_mask = rand(&[1, 3, 4, 4], 2)?;
    assert!(sdpa_memory_efficient(&q, &k, &v, Some(&bad_mask), 1.0, 2).is_err());
    Ok(())
}
