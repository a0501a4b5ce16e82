//! The fused linear cross-entropy: its loss and gradients against the plain composition
//! (matmul, log-softmax, gather) and against finite differences, chunked and not.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use common::*;
use ft_kernels::cross_entropy::{linear_cross_entropy, linear_cross_entropy_chunked};
use ft_kernels::softmax::log_softmax_last_dim;

/// The composition the fused op replaces.
fn plain(h: &Tensor, w: &Tensor, labels: &[i64]) -> Result<Tensor> {
    let d = w.dim(1)?;
    let logits = h.reshape(((), d))?.matmul(&w.t()?)?;
    let logp = log_softmax_last_dim(&logits)?;
    let mut total: Option<Tensor> = None;
    for (i, &l) in labels.iter().enumerate() {
        if l < 0 {
            continue;
        }
        let v = logp.get(i)?.get(l as usize)?.neg()?;
        total = Some(match total {
            Some(t) => (t + v)?,
            None => v,
        });
    }
    match total {
        Some(t) => Ok(t),
        None => Tensor::zeros((), h.dtype(), h.device()),
    }
}

const LABELS: [i64; 6] = [3, -100, 0, 6, 2, -1];

fn labels_tensor(shape: &[usize]) -> Result<Tensor> {
    Tensor::new(&LABELS, &Device::Cpu)?.reshape(shape)
}

#[test]
fn loss_and_gradients_match_the_plain_head_for_every_chunking() -> Result<()> {
    let h0 = (rand(&[2, 3, 4], 1)? * 2.0)?.to_dtype(DType::F32)?;
    let w0 = (rand(&[7, 4], 2)? * 2.0)?.to_dtype(DType::F32)?;
    let labels = labels_tensor(&[2, 3])?;
    let (h, w) = (Var::from_tensor(&h0)?, Var::from_tensor(&w0)?);
    let reference = plain(h.as_tensor(), w.as_tensor(), &LABELS)?;
    let rg = (&reference * 0.5)?.backward()?;
    for rows in [1, 2, 3, 100] {
        let loss = linear_cross_entropy_chunked(h.as_tensor(), w.as_tensor(), &labels, rows)?;
        assert_eq!(loss.dtype(), DType::F32);
        assert!(max_diff(&loss, &reference)? < 1e-5, "rows {rows}");
        // The incoming gradient (0.5) scales both gradients, as a mean over tokens does.
        let g = (&loss * 0.5)?.backward()?;
        for v in [&h, &w] {
            let (a, b) = (g.get(v).expect("grad"), rg.get(v).expect("grad"));
            assert!(rel_diff(a, b)? < 1e-5, "rows {rows}: {}", rel_diff(a, b)?);
        }
        let hg = g.get(&h).expect("grad").reshape((6, 4))?;
        // Ignored rows get exactly no gradient.
        for i in [1, 5] {
            assert_eq!(hg.get(i)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        }
    }
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    let h = (rand(&[6, 4], 3)? * 2.0)?;
    let w = (rand(&[7, 4], 4)? * 2.0)?;
    let labels = labels_tensor(&[6])?;
    for rows in [2, 6] {
        check_gradients(
            |xs| linear_cross_entropy_chunked(&xs[0], &xs[1], &labels, rows),
            &[h.clone(), w.clone()],
            EPS,
        )?
        .assert_close(TOL)?;
    }
    // A strided hidden state and a head used twice (a tied embedding also read elsewhere).
    check_gradients(
        |xs| {
            let ht = xs[0].t()?;
            linear_cross_entropy(&ht, &xs[1], &labels)? + xs[1].sqr()?.sum_all()?
        },
        &[h.t()?.contiguous()?, w],
        EPS,
    )?
    .assert_close(TOL)
}

#[test]
fn without_tracked_inputs_no_gradient_is_computed_or_kept() -> Result<()> {
    let h = rand(&[6, 4], 5)?.to_dtype(DType::F32)?;
    let w = rand(&[7, 4], 6)?.to_dtype(DType::F32)?;
    let labels = labels_tensor(&[6])?;
    let loss = linear_cross_entropy(&h, &w, &labels)?;
    assert!(!loss.track_op());
    assert!(max_diff(&loss, &plain(&h, &w, &LABELS)?)? < 1e-5);
    Ok(())
}

#[test]
fn bad_labels_and_shapes_are_errors() -> Result<()> {
    let h = rand(&[6, 4], 5)?;
    let w = rand(&[7, 4], 6)?;
    let out_of_vocab = Tensor::new(&[3i64, 7, 0, 0, 0, 0], &Device::Cpu)?;
    let e = linear_cross_entropy(&h, &w, &out_of_vocab).unwrap_err();
    assert!(e.to_string().contains("label 7 at row 1"), "{e}");
    let e = linear_cross_entropy(&h, &w, &labels_tensor(&[6])?.narrow(0, 0, 5)?).unwrap_err();
    assert!(e.to_string().contains("5 labels for 6 rows"), "{e}");
    let e =
        linear_cross_entropy(&h.narrow(D::Minus1, 0, 3)?, &w, &labels_tensor(&[6])?).unwrap_err();
    assert!(e.to_string().contains("hidden size 3"), "{e}");
    Ok(())
}

/// bf16 inputs (`--full-bf16`): the products run in bf16 and the loss, logits and `W`'s sum in
/// f32, as the plain head computes; both agree within bf16 rounding, and the gradients come
/// back in bf16.
#[test]
fn bf16_inputs_match_the_plain_head_within_bf16_rounding() -> Result<()> {
    let h0 = (rand(&[6, 16], 7)? * 2.0)?.to_dtype(DType::BF16)?;
    let w0 = (rand(&[11, 16], 8)? * 2.0)?.to_dtype(DType::BF16)?;
    let labels = Tensor::new(&[3i64, -100, 0, 10, 2, 5], &Device::Cpu)?;
    let (h, w) = (Var::from_tensor(&h0)?, Var::from_tensor(&w0)?);
    let logits = h
        .as_tensor()
        .matmul(&w.as_tensor().t()?)?
        .to_dtype(DType::F32)?;
    let logp = log_softmax_last_dim(&logits)?;
    let mut reference: Option<Tensor> = None;
    for (i, l) in [3i64, -100, 0, 10, 2, 5].into_iter().enumerate() {
        if l >= 0 {
            let v = logp.get(i)?.get(l as usize)?.neg()?;
            reference = Some(match reference {
                Some(t) => (t + v)?,
                None => v,
            });
        }
    }
    let reference = reference.expect("labels");
    let rg = (&reference / 5.0)?.backward()?;
    let loss = linear_cross_entropy_chunked(h.as_tensor(), w.as_tensor(), &labels, 2)?;
    assert!(rel_diff(&loss, &reference)? < 1e-5);
    let g = (&loss / 5.0)?.backward()?;
    for v in [&h, &w] {
        let (a, b) = (g.get(v).expect("grad"), rg.get(v).expect("grad"));
        assert_eq!(a.dtype(), DType::BF16);
        assert!(rel_diff(a, b)? < 2e-2, "{}", rel_diff(a, b)?);
    }
    Ok(())
}

/// A probability below f32's smallest normal value (a far-off token of a trained head) becomes
/// 0 in the f32 gradient, where it would be a subnormal number that x86 multiplies many times
/// slower; the others keep their value, and f64 keeps them all.
#[test]
fn tiny_probabilities_are_zero_and_the_rest_unchanged() -> Result<()> {
    // One row, h = [1]: the logits are W's column, exp(-100) and exp(-90) subnormal in f32,
    // exp(-10) normal.
    let col = [0.0, -100.0, -90.0, -10.0];
    let p = {
        let e: Vec<f64> = col.iter().map(|x: &f64| x.exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect::<Vec<f64>>()
    };
    let labels = Tensor::new(&[0i64], &Device::Cpu)?;
    for dt in [DType::F32, DType::F64] {
        let h = Var::from_tensor(&Tensor::new(&[[1.0f64]], &Device::Cpu)?.to_dtype(dt)?)?;
        let w = Var::from_tensor(
            &Tensor::new(&col, &Device::Cpu)?
                .reshape((4, 1))?
                .to_dtype(dt)?,
        )?;
        let loss = linear_cross_entropy(h.as_tensor(), w.as_tensor(), &labels)?;
        let gw: Vec<f64> = loss
            .backward()?
            .get(&w)
            .expect("grad")
            .flatten_all()?
            .to_dtype(DType::F64)?
            .to_vec1()?;
        let want = [p[0] - 1.0, p[1], p[2], p[3]];
        for (j, (&g, &x)) in gw.iter().zip(&want).enumerate() {
            if dt == DType::F32 && (x as f32).abs() < f32::MIN_POSITIVE {
                assert_eq!(g, 0.0, "f32 element {j}: {g:e} should be 0");
            } else {
                // The label's element is p - 1: its rounding is relative to 1, not to it.
                let scale = if j == 0 { 1.0 } else { x.abs() };
                let tol = if dt == DType::F32 { 1e-6 } else { 1e-14 };
                assert!(
                    (g - x).abs() <= tol * scale,
                    "{dt:?} element {j}: {g:e} vs {x:e}"
                );
            }
        }
    }
    Ok(())
}

/// A NaN logit makes a NaN loss (it is not lost in the row's maximum or its exponentials).
#[test]
fn a_nan_logit_makes_a_nan_loss() -> Result<()> {
    for dt in [DType::F32, DType::F64] {
        let h = Var::from_tensor(&Tensor::new(&[[1.0f64]], &Device::Cpu)?.to_dtype(dt)?)?;
        let col = [0.0, f64::NAN, -1.0];
        let w = Var::from_tensor(
            &Tensor::new(&col, &Device::Cpu)?
                .reshape((3, 1))?
                .to_dtype(dt)?,
        )?;
        for label in [0i64, 2] {
            let labels = Tensor::new(&[label], &Device::Cpu)?;
            let loss = linear_cross_entropy(h.as_tensor(), w.as_tensor(), &labels)?;
            let v = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            assert!(v.is_nan(), "{dt:?} label {label}: loss {v}");
        }
    }
    Ok(())
}
