//! Gradient checking against f64 central differences: the test every op of this crate (and
//! every model built from them) has to pass.
//!
//! The analytic gradient is that of `sum(f(x) * w)` for a fixed random `w`, so every output
//! element contributes with its own weight (a plain sum would hide errors that cancel, such as
//! a softmax backward that forgets the `- sum(g y)` term).

use candle_core::{DType, Device, Result, Tensor, Var};

/// A seeded uniform [-1, 1) tensor in f64 (cast it to the dtype under test).
pub fn random_tensor(shape: &[usize], seed: u64, device: &Device) -> Result<Tensor> {
    let mut state = seed ^ 0x5DEE_CE66_D1CE_4E5B;
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, device)
}

/// A random tensor of `shape` that is a non-contiguous view (the transpose of a contiguous
/// tensor of the last two dims swapped), to exercise strided inputs.
pub fn random_non_contiguous(shape: &[usize], seed: u64, device: &Device) -> Result<Tensor> {
    let r = shape.len();
    if r < 2 {
        return random_tensor(shape, seed, device);
    }
    let mut s = shape.to_vec();
    s.swap(r - 2, r - 1);
    random_tensor(&s, seed, device)?.transpose(r - 2, r - 1)
}

/// Worst disagreement between analytic and numeric gradients, per input.
#[derive(Debug, Clone, PartialEq)]
pub struct GradReport {
    /// (max abs error, max relative error, flat index of the worst element) per input.
    pub inputs: Vec<(f64, f64, usize)>,
}

impl GradReport {
    /// Errors when an input's relative error exceeds `tol` (relative to max(|a|, |n|, 1e-2)).
    pub fn assert_close(&self, tol: f64) -> Result<()> {
        for (i, (abs, rel, at)) in self.inputs.iter().enumerate() {
            if !(rel.is_finite() && *rel <= tol) {
                candle_core::bail!(
                    "gradient of input {i} is wrong: relative error {rel:.3e} (abs {abs:.3e}) at element {at}, tolerance {tol:.1e}"
                );
            }
        }
        Ok(())
    }
}

fn weighted_sum(y: &Tensor, w: &Tensor) -> Result<Tensor> {
    (y.to_dtype(DType::F64)? * w)?.sum_all()
}

/// Compares the backward of `f` with central differences of step `eps`, in f64.
///
/// `inputs` are cast to f64 (their values kept); `f` may reshape, transpose or slice them before
/// calling the op under test, which is how strided inputs are checked.
pub fn check_gradients(
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    eps: f64,
) -> Result<GradReport> {
    let xs: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F64)?.contiguous())
        .collect::<Result<_>>()?;
    let vars: Vec<Var> = xs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let vts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&vts)?;
    let w = random_tensor(y.dims(), 0xC0FFEE, y.device())?;
    let grads = weighted_sum(&y, &w)?.backward()?;
    let mut report = GradReport { inputs: Vec::new() };
    for (i, x) in xs.iter().enumerate() {
        let analytic: Vec<f64> = match grads.get(vars[i].as_tensor()) {
            Some(g) => g.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?,
            None => vec![0.0; x.elem_count()],
        };
        let base: Vec<f64> = x.flatten_all()?.to_vec1()?;
        let (mut worst_abs, mut worst_rel, mut at) = (0f64, 0f64, 0usize);
        for j in 0..base.len() {
            let eval = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[j] += delta;
                let mut args = xs.clone();
                args[i] = Tensor::from_vec(v, x.dims(), x.device())?;
                weighted_sum(&f(&args)?, &w)?.to_scalar::<f64>()
            };
            let numeric = (eval(eps)? - eval(-eps)?) / (2.0 * eps);
            let a = analytic[j];
            let abs = (a - numeric).abs();
            let rel = abs / a.abs().max(numeric.abs()).max(1e-2);
            if rel > worst_rel || rel.is_nan() {
                worst_rel = rel;
                at = j;
            }
            worst_abs = worst_abs.max(abs);
        }
        report.inputs.push((worst_abs, worst_rel, at));
    }
    Ok(report)
}
