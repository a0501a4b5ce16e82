//! What each optimizer's update allocates beyond its state (`OptimSpec::step_bytes`), against
//! the counting allocator's exact heap bytes on the CPU: one tensor at a time at several
//! shapes, and a step over several tensors, whose peak is the largest tensor's (each tensor's
//! new values replace its old ones before the next is updated). The plan counts these bytes
//! where the step runs: after backward, or inside a fused backward beside the activations it
//! still holds.

use candle_core::{Device, Tensor, Var};
use ft_trainer::ledger::alloc;
use ft_trainer::optim::registry::REGISTRY;
use ft_trainer::optim::{OptimSettings, OptimSpec};

use ft_trainer::ledger::alloc::alone;

#[global_allocator]
static ALLOC: alloc::CountingAlloc = alloc::CountingAlloc;

/// Bytes of bookkeeping the formulas leave out (a few small vectors and scalars; Adafactor's
/// reductions over a convolution's kernel dimensions hold 12 KiB more in a debug build than in
/// a release one).
const SLACK: u64 = 16 << 10;

/// The allocator counts every thread's bytes: one measurement at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The peak of the second step (the first makes the state) over tensors of `shapes`, f32
/// gradients.
fn second_step_peak(spec: &OptimSpec, shapes: &[Vec<usize>]) -> anyhow::Result<u64> {
    second_step_peak_with(spec, shapes, candle_core::DType::F32)
}

/// [`second_step_peak`] with gradients of `grad_dtype` (bf16 ones: `--precision bf16` with
/// fp32 masters, one micro-batch a step).
fn second_step_peak_with(
    spec: &OptimSpec,
    shapes: &[Vec<usize>],
    grad_dtype: candle_core::DType,
) -> anyhow::Result<u64> {
    alone(&ONE_AT_A_TIME, || {
        let settings = OptimSettings { weight_decay: 0.01 };
        let params = shapes
            .iter()
            .map(|d| {
                Ok(Var::from_tensor(&Tensor::randn(
                    0f32,
                    1.0,
                    d.as_slice(),
                    &Device::Cpu,
                )?)?)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let grads = shapes
            .iter()
            .map(|d| {
                Ok(Some(
                    Tensor::randn(0f32, 1.0, d.as_slice(), &Device::Cpu)?.to_dtype(grad_dtype)?,
                ))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut opt = (spec.build)(params.len(), &settings);
        opt.step(&params, &grads, 1e-3)?;
        let (r, peak) = alloc::measure_peak(|| opt.step(&params, &grads, 1e-3));
        r?;
        Ok(peak as u64)
    })
}

#[test]
fn each_optimizers_step_allocates_what_its_spec_says() -> anyhow::Result<()> {
    let shapes: [&[usize]; 5] = [&[384, 256], &[12_288], &[64, 32, 3, 3], &[7, 100], &[900]];
    let mut bad = Vec::new();
    for spec in REGISTRY {
        for dims in shapes {
            let measured = second_step_peak(spec, &[dims.to_vec()])?;
            let predicted = (spec.step_bytes)(dims);
            println!(
                "{:<10} {dims:?}: predicted {predicted}, measured {measured}",
                spec.name()
            );
            if measured.abs_diff(predicted) > predicted / 100 + SLACK {
                bad.push(format!(
                    "{} {dims:?}: {predicted} vs {measured}",
                    spec.name()
                ));
            }
        }
    }
    assert!(bad.is_empty(), "off by more than 1% + 16 KiB: {bad:?}");
    Ok(())
}

#[test]
fn a_step_over_several_tensors_peaks_at_the_largest() -> anyhow::Result<()> {
    let shapes = vec![vec![64, 64], vec![512, 256], vec![4096], vec![128, 96]];
    for spec in REGISTRY {
        let measured = second_step_peak(spec, &shapes)?;
        let largest = shapes
            .iter()
            .map(|d| (spec.step_bytes)(d))
            .max()
            .unwrap_or(0);
        println!(
            "{:<10}: largest tensor's {largest}, measured {measured}",
            spec.name()
        );
        assert!(
            measured.abs_diff(largest) <= largest / 100 + SLACK,
            "{}: {measured} B against the largest tensor's {largest} B",
            spec.name()
        );
    }
    Ok(())
}

/// AdamW's host pass reads a bf16 gradient as it is (widening per element): no f32 copy, so
/// its step allocates nothing beyond the bookkeeping there either.
#[test]
fn adamw_with_bf16_gradients_allocates_no_f32_copy() -> anyhow::Result<()> {
    let spec = REGISTRY
        .iter()
        .find(|s| s.name() == "adamw")
        .expect("adamw registered");
    let measured = second_step_peak_with(spec, &[vec![512, 256]], candle_core::DType::BF16)?;
    assert!(
        measured <= SLACK,
        "{measured} B (an f32 copy of the gradient is 524288 B)"
    );
    Ok(())
}

/// Under ZeRO the step frees its spent sums before the owners' updated weights travel
/// (`MixedOptimizer::step`, `Zero::share_updates`): the message, the weights' bytes, never
/// stands beside the fp32 sums. One rank under ZeRO-1 owns every parameter and lays out the
/// whole model's message, as an owner does; an fp32 model updated in place, so the message
/// (4 bytes a value) would lift the step's peak by itself beside the sums.
#[test]
fn a_zero_step_sends_its_weights_after_its_sums_are_gone() -> anyhow::Result<()> {
    use ft_trainer::optim::AdamWConfig;
    use ft_trainer::update::{MixedOptimizer, Precision, StatePlacement};
    let n = 1usize << 20;
    alone(&ONE_AT_A_TIME, || {
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, n, &Device::Cpu)?)?;
        let mut opt = MixedOptimizer::adamw(
            vec![("w".to_string(), w)],
            Precision::for_dtype(candle_core::DType::F32),
            StatePlacement::WithModel,
            AdamWConfig::default(),
            None,
        )?;
        let comm = std::rc::Rc::new(ft_dist::Comm::solo());
        opt.shard(1, comm.clone())?;
        let sums = || -> anyhow::Result<Vec<Option<Tensor>>> {
            Ok(vec![Some(Tensor::randn(0f32, 1.0, n, &Device::Cpu)?)])
        };
        // The first step makes the state; the second is measured.
        let g = opt.reduce_gradients(&comm, sums()?, &Device::Cpu)?;
        opt.step(g, 1e-3)?;
        let g = opt.reduce_gradients(&comm, sums()?, &Device::Cpu)?;
        let before = alloc::reset_peak();
        opt.step(g, 1e-3)?;
        let above = alloc::peak_bytes() - before;
        assert!(
            above < n,
            "the step rose {above} bytes above its start; the message alone is {} bytes",
            4 * n
        );
        Ok(())
    })
}
