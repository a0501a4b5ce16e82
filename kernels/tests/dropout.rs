//! Dropout with a mask drawn from a hash: the values are `x * mask` (the mask a sequential
//! splitmix64 draw), the gradient is the mask's product checked against finite differences, and
//! backward computes and keeps no gradient for the mask.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var};
use common::*;
use ft_kernels::dropout::{dropout, DropoutDraw};

const P: f64 = 0.25;
const SEED: u64 = 0xfeed;

/// The keep bits are a sequential draw: splitmix64 from `seed`, `skip` outputs on, each output's
/// upper 53 bits as a uniform number kept when below 1 - p.
#[test]
fn the_mask_is_a_sequential_splitmix_draw() -> Result<()> {
    let d = DropoutDraw {
        seed: SEED,
        skip: 40,
        p: P,
    };
    let mut state = SEED.wrapping_add(40u64.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for i in 0..500 {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let u = (z >> 11) as f64 / (1u64 << 53) as f64;
        assert_eq!(d.keeps(i), u < 1.0 - P, "element {i}");
    }
    Ok(())
}

/// The values are `x` times the mask in `x`'s dtype, bit for bit, in f32, bf16, f16 and f64, for a
/// contiguous and a transposed input; a part of the tensor drawn `skip` elements on is that
/// part of the whole.
#[test]
fn values_are_x_times_the_mask() -> Result<()> {
    let x = rand(&[6, 7, 5], 3)?;
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let x = x.to_dtype(dtype)?;
        for x in [x.clone(), x.transpose(1, 2)?] {
            let d = DropoutDraw {
                seed: SEED,
                skip: 0,
                p: P,
            };
            let want = (&x * d.mask(x.shape())?.to_dtype(dtype)?)?;
            let got = dropout(&x, P, SEED, 0)?;
            assert_eq!(max_diff(&got, &want)?, 0.0, "{dtype:?} {:?}", x.dims());
        }
        let whole = dropout(&x, P, SEED, 0)?;
        let tail = dropout(&x.narrow(0, 2, 4)?, P, SEED, 2 * 35)?;
        assert_eq!(max_diff(&whole.narrow(0, 2, 4)?, &tail)?, 0.0);
    }
    let kept = dropout(&Tensor::ones(10_000, DType::F32, &Device::Cpu)?, P, 1, 0)?
        .ne(0f32)?
        .to_dtype(DType::F32)?
        .mean_all()?
        .to_scalar::<f32>()?;
    assert!((kept - 0.75).abs() < 0.02, "kept {kept}");
    assert_eq!(max_diff(&dropout(&x, 0.0, SEED, 0)?, &x)?, 0.0);
    assert!(dropout(&x, 1.0, SEED, 0).is_err());
    Ok(())
}

#[test]
fn gradient_matches_finite_differences() -> Result<()> {
    let x = rand(&[3, 4, 5], 4)?;
    check_gradients(
        |xs| dropout(&xs[0].tanh()?, P, SEED, 9)?.sqr(),
        std::slice::from_ref(&x),
        EPS,
    )?
    .assert_close(TOL)
}

/// Backward's gradient store holds the input's gradient alone, nothing for a mask:
/// `x * mask` would add the mask's, an activation-sized tensor nothing reads.
#[test]
fn backward_keeps_no_mask_gradient() -> Result<()> {
    let x = Var::from_tensor(&rand(&[4, 8], 5)?)?;
    let y = dropout(x.as_tensor(), P, SEED, 0)?;
    let loss = y.sum_all()?;
    let grads = loss.backward()?;
    assert_eq!(grads.get_ids().count(), 1, "x's alone");
    let d = DropoutDraw {
        seed: SEED,
        skip: 0,
        p: P,
    };
    let g = grads.get(x.as_tensor()).expect("x's gradient");
    assert_eq!(max_diff(g, &d.mask(x.shape())?.to_dtype(DType::F64)?)?, 0.0);
    let masked = (x.as_tensor() * d.mask(x.shape())?.to_dtype(DType::F64)?)?;
    assert_eq!(
        masked.sum_all()?.backward()?.get_ids().count(),
        2,
        "x's and the mask's"
    );
    Ok(())
}
