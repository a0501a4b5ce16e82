//! The batched product `scale * op(a) op(b)`: the values of candle's matmul of the operands
//! times the scale (bit for bit where the operands lie as candle's call reads them, within
//! rounding where one is read transposed), and its gradients within rounding, for every pair of
//! transposes, f32 and f64, batches larger and smaller than the threads; finite differences;
//! no gradient for an input outside the graph; bad shapes one error; bf16 candle's ops.

mod common;
use candle_core::{DType, Result, Tensor, Var};
use common::*;
use ft_kernels::batched::{batched_matmul, is_one_op};

/// The last two axes swapped, made contiguous.
fn t(x: &Tensor) -> Result<Tensor> {
    let r = x.rank();
    x.transpose(r - 2, r - 1)?.contiguous()
}

#[test]
fn the_op_is_candles_matmul_times_the_scale() -> Result<()> {
    assert!(
        std::env::var("FT_BATCHED_OP").as_deref() != Ok("0"),
        "FT_BATCHED_OP=0 turns off the op this test checks"
    );
    // (batch dims, m, n, k): a batch larger than the threads (whose products are cut on one
    // thread each), one item (its product cut in blocks), rank 3.
    for (i, (batch, m, n, k)) in [
        (vec![2usize, 3], 17usize, 23usize, 9usize),
        (vec![1, 1], 300, 200, 64),
        (vec![5], 4, 6, 130),
    ]
    .into_iter()
    .enumerate()
    {
        for dtype in [DType::F32, DType::F64] {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                for scale in [1.0, 0.125, 0.3] {
                    let seed = 10 * i as u64;
                    let shape = |rows: usize, cols: usize, tr: bool| {
                        let mut d = batch.clone();
                        d.extend(if tr { [cols, rows] } else { [rows, cols] });
                        d
                    };
                    let var =
                        |d: Vec<usize>, s: u64| Var::from_tensor(&rand(&d, s)?.to_dtype(dtype)?);
                    let a = var(shape(m, k, ta), seed)?;
                    let b = var(shape(k, n, tb), seed + 1)?;
                    assert!(is_one_op(&a, &b));
                    let ours = batched_matmul(&a, &b, ta, tb, scale)?;
                    let oa = if ta { t(&a)? } else { a.as_tensor().clone() };
                    let ob = if tb { t(&b)? } else { b.as_tensor().clone() };
                    let want = (oa.matmul(&ob)? * scale)?;
                    let label = format!("{batch:?} {m}x{n}x{k} {dtype:?} t{ta}/{tb} scale {scale}");
                    if !ta && !tb {
                        // The same operand layouts as candle's call: the same sums.
                        assert!(same_bits(&ours, &want)?, "{label}: values");
                    } else {
                        // An operand read transposed where it lies: gemm may take another
                        // kernel for it (with 4 x 6 outputs and 130-long sums it did).
                        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-15 };
                        assert!(rel_diff(&ours, &want)? < tol, "{label}: values");
                    }
                    let probe = rand(ours.dims(), seed + 2)?.to_dtype(dtype)?;
                    let g = probed_gradients(&ours, &probe, &[&a, &b])?;
                    let h = probed_gradients(&want, &probe, &[&a, &b])?;
                    let tol = if dtype == DType::F32 { 1e-5 } else { 1e-13 };
                    assert!(rel_diff(&g[0], &h[0])? < tol, "{label}: a's gradient");
                    assert!(rel_diff(&g[1], &h[1])? < tol, "{label}: b's gradient");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let a = rand(&[2, 3, 4, 5], 1)?;
        let b = rand(&[2, 3, 5, 6], 2)?;
        let (a, b) = (if ta { t(&a)? } else { a }, if tb { t(&b)? } else { b });
        check_gradients(
            |xs| batched_matmul(&xs[0], &xs[1], ta, tb, 0.7),
            &[a, b],
            EPS,
        )?
        .assert_close(TOL)?;
    }
    Ok(())
}

#[test]
fn an_input_outside_the_graph_gets_no_gradient() -> Result<()> {
    let a = rand(&[4, 8, 5], 1)?.to_dtype(DType::F32)?;
    let b = rand(&[4, 6, 5], 2)?.to_dtype(DType::F32)?;
    let (av, bv) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
    let loss = |a: &Tensor, b: &Tensor| batched_matmul(a, b, false, true, 0.5)?.sqr()?.sum_all();
    let all = loss(&av, &bv)?.backward()?;
    let no_a = loss(&a, &bv)?.backward()?;
    assert!(no_a.get(&a).is_none());
    assert!(same_bits(no_a.get(&bv).unwrap(), all.get(&bv).unwrap())?);
    let no_b = loss(&av, &b)?.backward()?;
    assert!(no_b.get(&b).is_none());
    assert!(same_bits(no_b.get(&av).unwrap(), all.get(&av).unwrap())?);
    Ok(())
}

#[test]
fn bad_shapes_are_one_error_and_bf16_takes_candles_ops() -> Result<()> {
    let a = rand(&[2, 3, 4], 1)?;
    let err = batched_matmul(&a, &rand(&[2, 5, 6], 2)?, false, false, 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("batched matmul") && err.contains("inner"),
        "{err}"
    );
    let err = batched_matmul(&rand(&[4], 1)?, &a, false, false, 1.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("rank"), "{err}");
    let b = rand(&[2, 6, 4], 3)?;
    let (ab, bb) = (a.to_dtype(DType::BF16)?, b.to_dtype(DType::BF16)?);
    assert!(!is_one_op(&ab, &bb));
    let y = batched_matmul(&ab, &bb, false, true, 0.5)?;
    let want = batched_matmul(&a, &b, false, true, 0.5)?;
    assert!(rel_diff(&y, &want)? < 2e-2);
    Ok(())
}
