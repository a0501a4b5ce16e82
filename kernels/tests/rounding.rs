//! Stochastic rounding to bf16: exact values stay exact, the result is one of the two bf16
//! neighbours, the mean over seeds is the fp32 value (where round-to-nearest is off by up to
//! half a step), and a seed always gives the same bits.

use candle_core::{DType, Device, Result, Tensor};
use ft_kernels::rounding::round_stochastic_bf16;
use half::bf16;

fn bits(t: &Tensor) -> Result<Vec<u16>> {
    Ok(t.to_vec1::<bf16>()?.iter().map(|v| v.to_bits()).collect())
}

#[test]
fn representable_values_and_specials_are_unchanged() -> Result<()> {
    let v = [1.0f32, -2.5, 0.0, 3.0e38, f32::INFINITY, f32::NEG_INFINITY];
    let x = Tensor::new(&v, &Device::Cpu)?;
    for seed in 0..20 {
        let y = round_stochastic_bf16(&x, seed)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        assert_eq!(y[..3], v[..3]);
        assert_eq!(y[4..], v[4..]);
    }
    let nan = round_stochastic_bf16(&Tensor::new(&[f32::NAN], &Device::Cpu)?, 3)?;
    assert!(nan.to_dtype(DType::F32)?.to_vec1::<f32>()?[0].is_nan());
    Ok(())
}

#[test]
fn unbiased_between_the_two_neighbours() -> Result<()> {
    // 1 + 2^-9 lies a quarter of the way from 1 to the next bf16, 1 + 2^-7.
    let v = 1.0f32 + 2f32.powi(-9);
    let x = Tensor::from_vec(vec![v; 4096], 4096, &Device::Cpu)?;
    let lo = bf16::from_f32(1.0).to_bits();
    let hi = lo + 1;
    let mut mean = 0f64;
    for seed in 1..=8u64 {
        let b = bits(&round_stochastic_bf16(&x, seed)?)?;
        assert!(b.iter().all(|&u| u == lo || u == hi), "not a neighbour");
        mean += b.iter().map(|&u| bf16::from_bits(u).to_f64()).sum::<f64>() / b.len() as f64;
    }
    mean /= 8.0;
    let nearest = bf16::from_f32(v).to_f64();
    assert!((mean - v as f64).abs() < 2e-4, "mean {mean} vs {v}");
    assert!(
        (nearest - v as f64).abs() > 1e-3,
        "round to nearest is biased here"
    );
    Ok(())
}

#[test]
fn same_seed_same_bits() -> Result<()> {
    let x = Tensor::arange(0f32, 1000., &Device::Cpu)?.affine(1.0 / 7.0, 0.1)?;
    let a = bits(&round_stochastic_bf16(&x, 42)?)?;
    assert_eq!(a, bits(&round_stochastic_bf16(&x, 42)?)?);
    assert_ne!(a, bits(&round_stochastic_bf16(&x, 43)?)?);
    Ok(())
}
