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

/// Values and gradients agree to 1e-6 in f64 (the memory-efficient op keeps its mask in f32).
#[test]
fn memory_efficient_equals_plain_in_values_and_gradients() -> Result<()> {
    for (b, h, lq, lk, d, chunk) in [(2, 3, 7, 7, 4, 3), (1, 2, 5, 9, 3, 4), (2, 1, 6, 6, 2, 16)] {
        let (q, k, v) = qkv(b, h, lq, lk, d, 1)?;
        for mask in masks(b, h, lq, lk)? {
            let scale = 1.0 / (d as f64).sqrt();
            let (qv, kv, vv) = (
                Var::from_tensor(&q)?,
                Var::from_tensor(&k)?,
                Var::from_tensor(&v)?,
            );
            let w = rand(&[b, h, lq, d + 1], 5)?;
            let run = |me: bool| -> Result<(Tensor, Vec<Tensor>)> {
                let y = if me {
                    sdpa_memory_efficient(
                        qv.as_tensor(),
                        kv.as_tensor(),
                        vv.as_tensor(),
                        mask.as_ref(),
                        scale,
                        chunk,
                    )?
                } else {
                    sdpa(
                        qv.as_tensor(),
                        kv.as_tensor(),
                        vv.as_tensor(),
                        mask.as_ref(),
                        scale,
                    )?
                };
                let g = (&y * &w)?.sum_all()?.backward()?;
                let gs = [&qv, &kv, &vv]
                    .iter()
                    .map(|x| g.get(x.as_tensor()).cloned().expect("grad"))
                    .collect();
                Ok((y, gs))
            };
            let (y0, g0) = run(false)?;
            let (y1, g1) = run(true)?;
            assert!(
                max_diff(&y0, &y1)? < 1e-6,
                "values {b} {h} {lq} {lk} chunk {chunk}"
            );
            for (a, c) in g0.iter().zip(&g1) {
                assert!(
                    max_diff(a, c)? < 1e-6,
                    "gradients {b} {h} {lq} {lk} chunk {chunk}"
                );
            }
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
    let mut biases = masks(b, h, lq, lk)?;
    biases.push(Some(rand(&[lq, lk], 12)?));
    biases.push(Some(rand(&[b, 1, 1, lk], 13)?));
    for bias in biases {
        for rows in [1, 2, 3] {
            let vars = [&q, &k, &v]
                .into_iter()
                .chain(bias.as_ref())
                .map(Var::from_tensor)
                .collect::<Result<Vec<_>>>()?;
            let w = rand(&[b, h, lq, d + 1], 14)?;
            let run = |chunked: bool| -> Result<(Tensor, Vec<Tensor>)> {
                let x: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
                let bias = x.get(3).copied();
                let y = if chunked {
                    sdpa_query_chunks(x[0], x[1], x[2], bias, 0.5, b * h * lk * rows)?
                } else {
                    sdpa(x[0], x[1], x[2], bias, 0.5)?
                };
                let g = (&y * &w)?.sum_all()?.backward()?;
                let gs = x
                    .iter()
                    .map(|t| g.get(t).cloned().expect("every input has a gradient"))
                    .collect();
                Ok((y, gs))
            };
            let (y0, g0) = run(false)?;
            let (y1, g1) = run(true)?;
            let dims = bias.as_ref().map(|t| t.dims().to_vec());
            assert!(
                max_diff(&y0, &y1)? < 1e-12,
                "values, bias {dims:?}, {rows} rows"
            );
            for (a, c) in g0.iter().zip(&g1) {
                assert_eq!(a.dims(), c.dims());
                assert!(
                    max_diff(a, c)? < 1e-12,
                    "gradients, bias {dims:?}, {rows} rows"
                );
            }
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
