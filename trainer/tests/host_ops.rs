//! The threaded host passes of the offloaded optimizer (`ft_kernels::host`, the one-pass host
//! AdamW) give the bits of the candle ops they replace.

use candle_core::{DType, Device, Tensor, Var};
use ft_kernels::host::{add_into, narrowed, scaled, sum_squares, widened};
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer};

mod common;
use common::bits;

fn values(n: usize, seed: u64) -> Tensor {
    let mut rng = ft_params::rng::SplitMix64::new(seed);
    let mut v: Vec<f32> = (0..n).map(|_| rng.normal() as f32 * 3.0).collect();
    v[0] = -0.0;
    v[1] = 0.0;
    v[2] = 1.0 + f32::EPSILON; // rounds to even in bf16
    Tensor::from_vec(v, n, &Device::Cpu).expect("tensor")
}

/// Sizes split over threads (on any machine with 2+ cores) and one that is not.
const SIZES: [usize; 3] = [(1 << 17) + 3, 3 * (1 << 16) + 5, 1000];

#[test]
fn add_into_and_widened_give_candles_bits() -> candle_core::Result<()> {
    for n in SIZES {
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let g = values(n, 2).to_dtype(dt)?;
            let w = widened(&g).expect("host tensor")?;
            assert_eq!(bits(&w)?, bits(&g.to_dtype(DType::F32)?)?, "{dt:?} widen");
            let acc = values(n, 1);
            let want = (&acc + g.to_dtype(DType::F32)?)?;
            assert!(add_into(&acc, &g)?);
            assert_eq!(bits(&acc)?, bits(&want)?, "{dt:?} n {n} add");
        }
    }
    // Not for it: a strided gradient, an f32 sum it does not own the layout of.
    let acc = values(6, 1).reshape((2, 3))?;
    assert!(!add_into(&acc, &values(6, 2).reshape((3, 2))?.t()?)?);
    // Nor one of another shape with as many elements (the parameter order was broken).
    assert!(!add_into(&acc, &values(6, 2).reshape((3, 2))?)?);
    Ok(())
}

#[test]
fn scaled_narrowed_and_sum_squares_match_candle() -> candle_core::Result<()> {
    for n in SIZES {
        let g = values(n, 3);
        let s = scaled(&g, 0.3719).expect("host tensor")?;
        assert_eq!(bits(&s)?, bits(&(&g * 0.3719)?)?);
        for dt in [DType::BF16, DType::F16] {
            let w = narrowed(&g, dt).expect("host tensor")?;
            assert_eq!(w.dtype(), dt);
            assert_eq!(bits(&w)?, bits(&g.to_dtype(dt)?)?, "{dt:?} n {n}");
        }
        let ours = sum_squares(&g).expect("host tensor");
        let want: f64 = g
            .to_vec1::<f32>()?
            .iter()
            .map(|v| (*v as f64).powi(2))
            .sum();
        assert!((ours - want).abs() <= 1e-12 * want, "{ours} vs {want}");
        // Exactly the in-order sum of 65,536-element blocks, each the in-order sum of eight
        // lanes (element i into lane i % 8), whatever the number of threads.
        let blocks: f64 = g
            .to_vec1::<f32>()?
            .chunks(1 << 16)
            .map(|c| {
                let mut lanes = [0f64; 8];
                for (i, v) in c.iter().enumerate() {
                    lanes[i % 8] += (*v as f64) * (*v as f64);
                }
                lanes.iter().sum::<f64>()
            })
            .sum();
        assert_eq!(ours.to_bits(), blocks.to_bits(), "n {n}");
    }
    assert!(narrowed(&values(4, 1), DType::F32).is_none());
    Ok(())
}

/// The one-pass threaded host update gives the op-by-op reference's bits: weights and both
/// moments, over steps (first step without moments), with and without weight decay, for a
/// tensor split over threads and one too small to split, with f32 gradients and with bf16 and
/// f16 ones (which the pass widens per element, the reference with a cast first).
#[test]
fn host_adamw_matches_the_op_by_op_update_bit_for_bit() -> anyhow::Result<()> {
    for (n, wd, gdt) in [
        (300_001, 0.01, DType::F32),
        (1000, 0.0, DType::F32),
        (70_000, 0.3, DType::F32),
        (70_000, 0.01, DType::BF16),
        (1000, 0.01, DType::F16),
    ] {
        let cfg = AdamWConfig {
            weight_decay: wd,
            ..Default::default()
        };
        let p0 = values(n, 1);
        let fused_p = Var::from_tensor(&p0)?;
        let ref_p = Var::from_tensor(&p0)?;
        let mut fused = AdamW::new(1, cfg);
        let mut reference = AdamW::new(1, cfg).op_by_op();
        for step in 0..4u64 {
            let g = (values(n, 10 + step) * 1e-2)?.to_dtype(gdt)?;
            fused.step(std::slice::from_ref(&fused_p), &[Some(g.clone())], 1e-3)?;
            reference.step(std::slice::from_ref(&ref_p), &[Some(g)], 1e-3)?;
            assert_eq!(
                bits(&fused_p)?,
                bits(&ref_p)?,
                "n {n} {gdt:?} step {step}: weights"
            );
        }
        let (_, a) = fused.state();
        let (_, b) = reference.state();
        assert_eq!(a.len(), 2);
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            assert_eq!(bits(x)?, bits(y)?, "n {n}: {name}");
        }
    }
    Ok(())
}

/// A gradient that shares the weight's storage (a caller passing the weight's own values, say)
/// cannot be read while the weight is written in place under candle's lock: the update takes
/// the op-by-op path instead, with its bits, rather than waiting forever.
#[test]
fn host_adamw_with_a_gradient_sharing_the_weights_storage_takes_the_op_by_op_path(
) -> anyhow::Result<()> {
    let p0 = values(5000, 3);
    let (fused_p, ref_p) = (Var::from_tensor(&p0)?, Var::from_tensor(&p0)?);
    let mut fused = AdamW::new(1, AdamWConfig::default());
    let mut reference = AdamW::new(1, AdamWConfig::default()).op_by_op();
    for step in 0..3 {
        let own = fused_p.as_tensor().detach();
        assert_eq!(
            ft_kernels::host::storage_key(&own),
            ft_kernels::host::storage_key(fused_p.as_tensor())
        );
        let copy = ref_p.as_tensor().copy()?;
        fused.step(std::slice::from_ref(&fused_p), &[Some(own)], 1e-3)?;
        reference.step(std::slice::from_ref(&ref_p), &[Some(copy)], 1e-3)?;
        assert_eq!(bits(&fused_p)?, bits(&ref_p)?, "step {step}");
    }
    Ok(())
}
