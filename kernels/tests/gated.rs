//! `act(gate) * value` (T5's two projections, GEGLU's halves): gradients against finite
//! differences, and forward and gradients equal to the two ops they replace, bit for bit in every
//! float dtype, on the single and the threaded pass.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use common::*;
use ft_kernels::activation::{activate, Activation};
use ft_kernels::gated::{gated, gated_halves};

const ALL: [Activation; 4] = [
    Activation::GeluTanh,
    Activation::GeluErf,
    Activation::Silu,
    Activation::Relu,
];

/// The two ops: the activation, then the product.
fn two_ops(gate: &Tensor, value: &Tensor, a: Activation) -> Result<Tensor> {
    activate(gate, a)? * value
}

/// GEGLU as diffusers writes it: `value, gate = h.chunk(2, -1)`.
fn two_ops_halves(h: &Tensor, a: Activation) -> Result<Tensor> {
    let n = h.dim(D::Minus1)? / 2;
    two_ops(&h.narrow(D::Minus1, n, n)?, &h.narrow(D::Minus1, 0, n)?, a)
}

#[test]
fn gradients_match_finite_differences() -> Result<()> {
    for a in ALL {
        let (gate, value) = ((rand(&[4, 9], 1)? * 3.0)?, rand(&[4, 9], 2)?);
        check_gradients(|xs| gated(&xs[0], &xs[1], a), &[gate, value], EPS)?.assert_close(TOL)?;
        let h = (rand(&[2, 3, 10], 3)? * 3.0)?;
        check_gradients(|xs| gated_halves(&xs[0], a), &[h], EPS)?.assert_close(TOL)?;
        // Strided operands are made contiguous first; a gate read twice accumulates.
        let x = rand(&[3, 5, 4], 4)?;
        check_gradients(
            |xs| gated(&xs[0].transpose(1, 2)?, &xs[0].transpose(1, 2)?, a),
            &[x],
            EPS,
        )?
        .assert_close(TOL)?;
    }
    Ok(())
}

/// The output and both gradients (of `sum(y * probe)`) of `f` at `inputs`, as f64.
fn run(
    inputs: &[Tensor],
    probe: &Tensor,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<Vec<Vec<f64>>> {
    let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let grads = probed_gradients(
        &y,
        &probe.to_dtype(y.dtype())?,
        &ts.iter().collect::<Vec<_>>(),
    )?;
    std::iter::once(y)
        .chain(grads)
        .map(|t| t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>())
        .collect()
}

/// Forward and gradients equal the two ops' bit for bit (f32, bf16, f16 and f64), on
/// `rows` x `width` operands.
fn equal_to_the_two_ops(rows: usize, width: usize) -> Result<()> {
    let shape = [rows, width];
    let gate = (Tensor::rand(-4f32, 4f32, &shape, &Device::Cpu)?).to_dtype(DType::F64)?;
    let value = (Tensor::rand(-2f32, 2f32, &shape, &Device::Cpu)?).to_dtype(DType::F64)?;
    let probe = Tensor::rand(-1f32, 1f32, &shape, &Device::Cpu)?;
    let h = Tensor::cat(&[&value, &gate], 1)?;
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let (g, v, h) = (
            gate.to_dtype(dtype)?,
            value.to_dtype(dtype)?,
            h.to_dtype(dtype)?,
        );
        for a in ALL {
            let ours = run(&[g.clone(), v.clone()], &probe, &|x| gated(&x[0], &x[1], a))?;
            let theirs = run(&[g.clone(), v.clone()], &probe, &|x| {
                two_ops(&x[0], &x[1], a)
            })?;
            assert!(ours == theirs, "{a:?} {dtype:?} {rows}x{width}: apart");
            let ours = run(std::slice::from_ref(&h), &probe, &|x| {
                gated_halves(&x[0], a)
            })?;
            let theirs = run(std::slice::from_ref(&h), &probe, &|x| {
                two_ops_halves(&x[0], a)
            })?;
            assert!(ours == theirs, "{a:?} {dtype:?} {rows}x{width}: halves");
        }
    }
    Ok(())
}

#[test]
fn short_tensors_equal_the_two_ops_bit_for_bit() -> Result<()> {
    equal_to_the_two_ops(6, 11)
}

#[test]
fn long_tensors_take_the_threaded_pass_with_the_same_bits() -> Result<()> {
    // More than two chunks of elements, in rows that do not divide a chunk.
    equal_to_the_two_ops(2 * ft_kernels::host::CHUNK / 1000 + 3, 1000)?;
    // Rows wider than a chunk.
    equal_to_the_two_ops(3, ft_kernels::host::CHUNK + 5)
}

#[test]
fn bad_shapes_are_refused_and_empty_ones_pass() -> Result<()> {
    let e = gated(&rand(&[2, 3], 1)?, &rand(&[3, 2], 2)?, Activation::GeluTanh)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("[2, 3]") && e.contains("[3, 2]"), "{e}");
    let e = gated_halves(&rand(&[2, 5], 1)?, Activation::GeluErf)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("must be even") && e.contains("[2, 5]"), "{e}");
    // Empty operands give empty results and gradients (no zero-width rows to walk).
    for shape in [[2usize, 0], [0, 6]] {
        let h = candle_core::Var::from_tensor(&rand(&shape, 3)?)?;
        let y = gated_halves(h.as_tensor(), Activation::GeluErf)?;
        assert_eq!(y.dims(), [shape[0], shape[1] / 2]);
        let g = y.sum_all()?.backward()?;
        let gh = g.get(h.as_tensor()).map(|t| t.dims().to_vec());
        assert_eq!(gh, Some(shape.to_vec()));
    }
    Ok(())
}
