//! The gradient tap: with it open, the ops hand their parameters' gradients over past candle's
//! store, with the values candle's store would have held; with it closed, nothing changes.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use common::*;
use ft_kernels::{conv, cross_entropy, grad_tap, linear, norm};

/// A loss over the four ops that hand gradients over: a conv with bias, a group norm, a linear
/// layer with bias used twice (its weight's gradient is a sum), a layer norm and the
/// cross-entropy's output projection.
struct Net {
    x: Var,
    conv_w: Var,
    conv_b: Var,
    gn_w: Var,
    gn_b: Var,
    lin_w: Var,
    lin_b: Var,
    ln_w: Var,
    ln_b: Var,
    out_w: Var,
}

impl Net {
    fn new() -> Result<Self> {
        let v = |shape: &[usize], seed| Var::from_tensor(&rand(shape, seed)?.to_dtype(DType::F32)?);
        Ok(Net {
            x: v(&[2, 3, 6, 6], 1)?,
            conv_w: v(&[4, 3, 3, 3], 2)?,
            conv_b: v(&[4], 3)?,
            gn_w: v(&[4], 4)?,
            gn_b: v(&[4], 5)?,
            lin_w: v(&[8, 8], 6)?,
            lin_b: v(&[8], 7)?,
            ln_w: v(&[8], 8)?,
            ln_b: v(&[8], 9)?,
            out_w: v(&[5, 8], 10)?,
        })
    }

    fn params(&self) -> Vec<&Var> {
        vec![
            &self.x,
            &self.conv_w,
            &self.conv_b,
            &self.gn_w,
            &self.gn_b,
            &self.lin_w,
            &self.lin_b,
            &self.ln_w,
            &self.ln_b,
            &self.out_w,
        ]
    }

    fn loss(&self) -> Result<Tensor> {
        let h = conv::conv2d(&self.x, &self.conv_w, Some(&self.conv_b), 1, 1)?;
        let h = norm::group_norm(&h, 2, Some(&self.gn_w), Some(&self.gn_b), 1e-5)?;
        // [2, 4, 6, 6] -> 36 rows of 8.
        let h = h.reshape((36, 8))?;
        let h = linear::linear(&h, &self.lin_w, Some(&self.lin_b))?.tanh()?;
        let h = linear::linear(&h, &self.lin_w, Some(&self.lin_b))?;
        let h = norm::layer_norm(&h, Some(&self.ln_w), Some(&self.ln_b), 1e-5)?;
        let labels: Vec<u32> = (0..36).map(|i| i % 5).collect();
        let labels = Tensor::new(labels, h.device())?;
        cross_entropy::linear_cross_entropy(&h, &self.out_w, &labels)
    }
}

#[test]
fn an_open_tap_holds_the_parameters_gradients_with_candles_values() -> Result<()> {
    let net = Net::new()?;
    let plain = net.loss()?.backward()?;
    let _tap = grad_tap::open();
    let mut tapped = net.loss()?.backward()?;
    for (i, p) in net.params().into_iter().enumerate() {
        let want = plain
            .get(p.as_tensor())
            .expect("a gradient for every input");
        let in_store = tapped.get(p.as_tensor()).is_some();
        // The input x is no op's parameter slot: candle's store keeps its gradient.
        assert_eq!(in_store, i == 0, "input {i} in candle's store: {in_store}");
        let got = grad_tap::remove(&mut tapped, p.as_tensor())?.expect("a gradient");
        assert!(same_bits(&got, want)?, "input {i}: gradients differ");
        assert!(grad_tap::take(p.id()).is_none(), "taken once");
    }
    Ok(())
}

#[test]
fn a_closed_tap_changes_nothing() -> Result<()> {
    let net = Net::new()?;
    {
        let _tap = grad_tap::open();
    }
    let grads = net.loss()?.backward()?;
    for p in net.params() {
        assert!(grads.get(p.as_tensor()).is_some());
        assert!(grad_tap::take(p.id()).is_none());
    }
    // And a gradient offered with no tap open comes back.
    let g = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    assert!(grad_tap::hand_over(net.conv_b.as_tensor(), Some(g))?.is_some());
    Ok(())
}

#[test]
fn a_nested_open_leaves_the_outer_tap_open_and_closing_forgets() -> Result<()> {
    let net = Net::new()?;
    let outer = grad_tap::open();
    {
        let _inner = grad_tap::open();
    }
    let grads = net.loss()?.backward()?;
    assert!(grads.get(net.lin_w.as_tensor()).is_none());
    drop(outer);
    // What was not taken is gone with the tap.
    assert!(grad_tap::take(net.lin_w.id()).is_none());
    Ok(())
}

#[test]
fn a_weight_made_from_a_parameter_goes_through_candles_store() -> Result<()> {
    // A weight computed from a parameter (a cast, a scale) is no variable: the op returns its
    // gradient to candle, whose chain takes it to the parameter.
    let w = Var::from_tensor(&rand(&[3, 4], 1)?)?;
    let x = rand(&[5, 4], 2)?;
    let scaled = (w.as_tensor() * 2.0)?;
    let _tap = grad_tap::open();
    let grads = linear::linear(&x, &scaled, None)?.sum_all()?.backward()?;
    assert!(grad_tap::take(w.id()).is_none());
    let g = grads.get(w.as_tensor()).expect("through candle");
    // d/dW sum(x (2W)^T) = 2 * column sums of x, broadcast over the rows.
    let want = (x.sum_keepdim(0)? * 2.0)?.broadcast_as((3, 4))?;
    assert!(max_diff(g, &want)? < 1e-12);
    Ok(())
}
