//! A convolution and the batch norm after it (and its ReLU, or its ReLU and max pool) as one op:
//! values and statistics the separate ops' bit for bit, gradients of the input, weight, the
//! convolution's bias and the batch norm's weight and bias equal to theirs (`==`: candle's sum
//! into a zeroed slot, which the op skips, turns a `-0.0` into `+0.0`), in f32 and f64, with
//! and without a bias, single images and grouped ones, an input outside the graph; finite
//! differences; bad shapes one error; other dtypes the separate ops.

mod common;
use candle_core::{DType, Result, Tensor, Var};
use common::*;
use ft_kernels::batch_norm_pool::MaxPool;
use ft_kernels::conv::{BnTail, ConvBatchNorm};

const BN_EPS: f64 = 1e-5;

/// These tests compare the op with the separate ops: under `FT_CONV_BN_OP=0` both sides would
/// be the separate ops, so they refuse to run there.
fn the_op_is_on() {
    assert!(
        std::env::var("FT_CONV_BN_OP").as_deref() != Ok("0"),
        "FT_CONV_BN_OP=0 turns off the op these tests check"
    );
}

const TAILS: [BnTail; 4] = [
    BnTail::Plain,
    BnTail::Relu,
    BnTail::ReluMaxPool(MaxPool {
        pad: 0,
        kernel: (2, 2),
        stride: (2, 2),
    }),
    BnTail::ReluMaxPool(MaxPool {
        pad: 1,
        kernel: (3, 3),
        stride: (2, 2),
    }),
];

/// Whether `a` and `b` have one shape and equal values (`==`: the two zeros equal).
fn equal(a: &Tensor, b: &Tensor) -> Result<bool> {
    let v = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.flatten_all()?.to_vec1() };
    Ok(a.dims() == b.dims() && v(a)? == v(b)?)
}

#[test]
fn values_statistics_and_gradients_are_the_separate_ops() -> Result<()> {
    the_op_is_on();
    // (input, output channels, kernel, stride, padding): a 3x3 conv; a strided one; a 1x1
    // shortcut; a deep layer's small maps, whose images the convolution multiplies in groups.
    let cases = [
        ([4usize, 3, 9, 9], 5usize, 3usize, 1usize, 1usize),
        ([3, 4, 10, 10], 6, 3, 2, 1),
        ([5, 4, 6, 6], 3, 1, 2, 0),
        ([40, 6, 3, 3], 4, 3, 1, 1),
    ];
    let mut checked = 0;
    for (i, (shape, o, k, stride, pad)) in cases.into_iter().enumerate() {
        for dtype in [DType::F32, DType::F64] {
            for (t, tail) in TAILS.into_iter().enumerate() {
                for (with_bias, x_in_graph) in [(false, true), (true, true), (true, false)] {
                    let seed = 100 * i as u64 + 10 * t as u64;
                    let var = |t: Tensor| Var::from_tensor(&t.to_dtype(dtype)?);
                    let c = shape[1];
                    let x = var(rand(&shape, seed)?)?;
                    let w = var((rand(&[o, c, k, k], seed + 1)? * 0.5)?)?;
                    let bias = var(rand(&[o], seed + 2)?)?;
                    let gamma = var((rand(&[o], seed + 3)? + 1.5)?)?;
                    let beta = var((rand(&[o], seed + 4)? * 0.5)?)?;
                    let input = match x_in_graph {
                        true => x.as_tensor().clone(),
                        false => x.as_tensor().detach(),
                    };
                    let spec = ConvBatchNorm {
                        weight: &w,
                        bias: with_bias.then_some(bias.as_tensor()),
                        stride,
                        pad,
                        gamma: &gamma,
                        beta: &beta,
                        eps: BN_EPS,
                        tail,
                    };
                    let (ours, s) = spec.train(&input)?;
                    let (want, r) = spec.separate(&input)?;
                    let case =
                        format!("{shape:?} -> {o}, {tail:?}, {dtype:?}, bias {with_bias}, x in graph {x_in_graph}");
                    assert!(same_bits(&ours, &want)?, "{case}: values");
                    assert_eq!(s, r, "{case}: statistics");
                    let probe = rand(ours.dims(), seed + 5)?.to_dtype(dtype)?;
                    let mut of = vec![w.as_tensor(), gamma.as_tensor(), beta.as_tensor()];
                    let mut names = vec!["weight", "gamma", "beta"];
                    if with_bias {
                        of.push(bias.as_tensor());
                        names.push("bias");
                    }
                    if x_in_graph {
                        of.push(x.as_tensor());
                        names.push("x");
                    }
                    let (g, h) = (
                        probed_gradients(&ours, &probe, &of)?,
                        probed_gradients(&want, &probe, &of)?,
                    );
                    for (name, (a, b)) in names.iter().zip(g.iter().zip(&h)) {
                        assert!(equal(a, b)?, "{case}: gradient of {name}");
                    }
                    if !x_in_graph {
                        let grads = (&ours * &probe)?.sum_all()?.backward()?;
                        assert!(
                            grads.get(x.as_tensor()).is_none(),
                            "{case}: a gradient of x"
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 4 * 2 * 4 * 3);
    Ok(())
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    the_op_is_on();
    for tail in TAILS {
        let x = (rand(&[2, 2, 6, 6], 31)? * 2.0)?;
        let w = (rand(&[3, 2, 3, 3], 32)? * 0.5)?;
        let bias = rand(&[3], 33)?;
        let gamma = (rand(&[3], 34)? + 1.5)?;
        let beta = (rand(&[3], 35)? * 0.5)?;
        check_gradients(
            |t| {
                let spec = ConvBatchNorm {
                    weight: &t[1],
                    bias: Some(&t[2]),
                    stride: 1,
                    pad: 1,
                    gamma: &t[3],
                    beta: &t[4],
                    eps: BN_EPS,
                    tail,
                };
                Ok(spec.train(&t[0])?.0)
            },
            &[x, w, bias, gamma, beta],
            EPS,
        )?
        .assert_close(1e-5)?;
    }
    Ok(())
}

#[test]
fn bad_shapes_are_one_error_and_other_dtypes_take_the_separate_ops() -> Result<()> {
    the_op_is_on();
    let x = rand(&[2, 3, 5, 5], 41)?;
    let w = rand(&[4, 3, 3, 3], 42)?;
    let (gamma, beta) = (rand(&[4], 43)?, rand(&[4], 44)?);
    let spec = |w, gamma, beta| ConvBatchNorm {
        weight: w,
        bias: None,
        stride: 1,
        pad: 1,
        gamma,
        beta,
        eps: BN_EPS,
        tail: BnTail::Relu,
    };
    let short = rand(&[3], 45)?;
    let e = spec(&w, &short, &short).train(&x).err();
    let e = e.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        e.contains("[2, 3], not [2, 4]"),
        "a batch norm of 3 for 4 channels: {e}"
    );
    let wrong = rand(&[4, 2, 3, 3], 46)?;
    let e = spec(&wrong, &gamma, &beta).train(&x).err();
    let e = e.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        e.contains("does not fit input"),
        "a weight for 2 channels: {e}"
    );
    // bf16 on the CPU: the separate ops, the same values.
    let bf = |t: &Tensor| t.to_dtype(DType::BF16);
    let (wb, gb, bb) = (bf(&w)?, bf(&gamma)?, bf(&beta)?);
    let (ours, _) = spec(&wb, &gb, &bb).train(&bf(&x)?)?;
    let (want, _) = spec(&wb, &gb, &bb).separate(&bf(&x)?)?;
    assert_eq!(ours.dtype(), DType::BF16);
    assert!(same_bits(&ours, &want)?);
    Ok(())
}
