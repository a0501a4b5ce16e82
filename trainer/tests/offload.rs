//! Optimizer state in host memory (`StatePlacement::Host`, `--offload-optimizer`): the same
//! updates as state kept beside the model, checkpoints that resume exactly, and the ledger told
//! where the bytes are. The device-memory saving itself needs a GPU: `tests/cuda.rs`.

use candle_core::{DType, Device, Tensor, Var};
use ft_trainer::ledger::{Category, Ledger};
use ft_trainer::optim::AdamWConfig;
use ft_trainer::update::{GradAccumulator, MixedOptimizer, Precision, StatePlacement};

mod common;
use common::bits;

const SHAPES: [&[usize]; 3] = [&[7, 5], &[33], &[2, 3, 4]];

fn randn(shape: &[usize], seed: u64) -> anyhow::Result<Tensor> {
    let mut rng = ft_params::rng::SplitMix64::new(seed);
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

fn params(dtype: DType, seed: u64) -> anyhow::Result<Vec<(String, Var)>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let t = randn(s, seed + i as u64)?.to_dtype(dtype)?;
            Ok((format!("p{i}"), Var::from_tensor(&t)?))
        })
        .collect()
}

fn grads(dtype: DType, step: u64) -> anyhow::Result<Vec<Option<Tensor>>> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| {
            // The middle parameter misses a gradient at some steps (None is skipped).
            if i == 1 && step % 3 == 1 {
                return Ok(None);
            }
            let g = randn(s, 100 * step + i as u64)?;
            Ok(Some((g * 3.0)?.to_dtype(dtype)?))
        })
        .collect()
}

fn optimizer(dtype: DType, placement: StatePlacement) -> anyhow::Result<MixedOptimizer> {
    let precision = Precision::for_dtype(dtype);
    let cfg = AdamWConfig {
        weight_decay: 0.1,
        ..Default::default()
    };
    Ok(MixedOptimizer::adamw(
        params(dtype, 7)?,
        precision,
        placement,
        cfg,
        Some(1.0),
    )?)
}

/// Every weight and every moment comes out bit for bit as with the state beside the model, in
/// f32 (where offloading adds masters the in-place update does not have), bf16 and f16 (loss
/// scaling), with clipping active and a parameter that misses a gradient.
#[test]
fn offloaded_state_gives_the_same_updates() -> anyhow::Result<()> {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let mut near = optimizer(dtype, StatePlacement::WithModel)?;
        let mut host = optimizer(dtype, StatePlacement::Host)?;
        assert_eq!(host.placement(), StatePlacement::Host);
        assert_eq!(
            host.masters().len(),
            SHAPES.len(),
            "{dtype:?}: host masters"
        );
        assert!(host.masters().iter().all(|m| m.dtype() == DType::F32));
        let mut applied = 0;
        for step in 0..8 {
            let scale = near.loss_scale();
            let scaled = |g: Vec<Option<Tensor>>| -> anyhow::Result<Vec<Option<Tensor>>> {
                g.into_iter()
                    .map(|g| {
                        Ok(
                            g.map(|g| (g.to_dtype(DType::F32)? * scale)?.to_dtype(dtype))
                                .transpose()?,
                        )
                    })
                    .collect()
            };
            let a = near.step(scaled(grads(dtype, step)?)?, 1e-2)?;
            let b = host.step(scaled(grads(dtype, step)?)?, 1e-2)?;
            assert_eq!(a, b, "{dtype:?} step {step}");
            applied += a.applied as usize;
        }
        // f16 skips steps until its loss scale has backed off below the overflow.
        assert!(applied >= 3, "{dtype:?}: only {applied} steps applied");
        for (i, (a, b)) in near.params().iter().zip(host.params()).enumerate() {
            assert_eq!(bits(a)?, bits(b)?, "{dtype:?}: weight {i}");
        }
        let (na, sa, ta) = near.state();
        let (nb, sb, tb) = host.state();
        assert_eq!((na, sa), (nb, sb));
        for (name, t) in &ta {
            let other = tb.iter().find(|(n, _)| n == name);
            let (_, u) = other.ok_or_else(|| anyhow::anyhow!("{dtype:?}: {name} missing"))?;
            assert_eq!(bits(t)?, bits(u)?, "{dtype:?}: {name}");
        }
    }
    Ok(())
}

/// A checkpoint of offloaded state restores into offloaded state and the next step is the one
/// the uninterrupted optimizer takes.
#[test]
fn offloaded_state_resumes_exactly() -> anyhow::Result<()> {
    let mut a = optimizer(DType::BF16, StatePlacement::Host)?;
    for step in 0..2 {
        a.step(grads(DType::BF16, step)?, 1e-2)?;
    }
    let (t, scale, tensors) = a.state();
    let mut b = optimizer(DType::BF16, StatePlacement::Host)?;
    for (p, q) in b.params().iter().zip(a.params()) {
        p.set(q.as_tensor())?;
    }
    // As the trainer restores: one tensor at a time, each a copy of its own.
    for (name, tensor) in &tensors {
        b.load_state(t, scale, &[(name.clone(), tensor.copy()?)])?;
    }
    a.step(grads(DType::BF16, 2)?, 1e-2)?;
    b.step(grads(DType::BF16, 2)?, 1e-2)?;
    for (p, q) in a.params().iter().zip(b.params()) {
        assert_eq!(bits(p)?, bits(q)?);
    }
    for (p, q) in a.masters().iter().zip(b.masters()) {
        assert_eq!(bits(p)?, bits(q)?);
        assert!(q.device().is_cpu());
    }
    Ok(())
}

/// On a CPU run the host is the measured memory, so offloaded state counts in the told totals
/// (on a GPU it is listed apart: `tests/cuda.rs`).
#[test]
fn ledger_counts_offloaded_state_where_it_lives() -> anyhow::Result<()> {
    let mut opt = optimizer(DType::BF16, StatePlacement::Host)?;
    opt.step(grads(DType::BF16, 0)?, 1e-2)?;
    assert!(opt.state_device().is_cpu());
    let mut ledger = Ledger::new(&Device::Cpu);
    opt.account(&mut ledger, "model");
    let elems: usize = SHAPES.iter().map(|s| s.iter().product::<usize>()).sum();
    assert_eq!(ledger.told(Category::MasterWeights), 4 * elems as u64);
    assert_eq!(ledger.told(Category::OptimizerState), 8 * elems as u64);
    assert!(ledger.host_by_category().is_empty());
    Ok(())
}

/// Gradients summed on a pinned device equal the sums on their own device, and the accumulator
/// says where they are.
#[test]
fn accumulator_on_a_device_sums_the_same() -> anyhow::Result<()> {
    let mut own = GradAccumulator::new();
    let mut pinned = GradAccumulator::on(&Device::Cpu);
    for step in 0..3 {
        own.add(grads(DType::BF16, step)?)?;
        pinned.add(grads(DType::BF16, step)?)?;
    }
    assert!(pinned.device().is_cpu());
    assert_eq!(own.bytes(), pinned.bytes());
    for (a, b) in own.take().iter().zip(pinned.take()) {
        match (a, b) {
            (Some(a), Some(b)) => {
                assert_eq!(a.dtype(), DType::F32);
                assert_eq!(bits(a)?, bits(&b)?);
            }
            (None, None) => {}
            _ => anyhow::bail!("one accumulator missed a gradient"),
        }
    }
    Ok(())
}

/// The bench plans' model-state table: FLAN-T5-XL's and the SDXL UNet's parameter counts give the
/// figures README.md and the seed presets quote.
#[test]
fn model_states_table_gives_the_quoted_figures() {
    let t5 = ft_trainer::train::bench::model_states_table(2_849_757_184);
    eprintln!("{t5}");
    assert!(
        t5.contains("| model states, at most | 53.08 GiB | 10.62 GiB | 42.46 GiB |"),
        "{t5}"
    );
    let sdxl = ft_trainer::train::bench::model_states_table(2_567_463_684);
    eprintln!("{sdxl}");
    assert!(
        sdxl.contains("| model states, at most | 47.82 GiB | 9.56 GiB | 38.26 GiB |"),
        "{sdxl}"
    );
}

/// An fp32 model's checkpoint from a run with the state on the host holds masters; resumed with
/// the state beside the model (no masters there) they set the weights, which they equal, and the
/// run goes on as the offloaded one does.
#[test]
fn fp32_offloaded_checkpoint_resumes_with_the_state_beside_the_model() -> anyhow::Result<()> {
    let mut host = optimizer(DType::F32, StatePlacement::Host)?;
    host.step(grads(DType::F32, 0)?, 1e-2)?;
    let (t, scale, tensors) = host.state();
    assert!(tensors.iter().any(|(n, _)| n.starts_with("master.")));
    let mut near = optimizer(DType::F32, StatePlacement::WithModel)?;
    assert!(near.masters().is_empty());
    for (name, tensor) in &tensors {
        near.load_state(t, scale, &[(name.clone(), tensor.copy()?)])?;
    }
    host.step(grads(DType::F32, 2)?, 1e-2)?;
    near.step(grads(DType::F32, 2)?, 1e-2)?;
    for (a, b) in host.params().iter().zip(near.params()) {
        assert_eq!(bits(a)?, bits(b)?);
    }
    Ok(())
}

/// A GPU run whose host state exceeds the host memory available is warned about before it
/// starts (on Linux, where /proc/meminfo says what is available); a CPU run keeps nothing apart.
#[test]
fn plan_warns_when_the_host_state_does_not_fit() {
    use ft_trainer::train::plan::{host_available, state_plan};
    let precision = Precision::for_dtype(DType::BF16);
    let huge = [vec![1usize << 45]]; // 35 trillion parameters: 512 TiB of host state
    let plan = state_plan(
        &huge,
        &precision,
        StatePlacement::Host,
        &ft_trainer::optim::adamw::SPEC,
        2,
        true,
    );
    assert_eq!(plan.host_bytes(), 16 << 45);
    assert_eq!(plan.device_bytes(), 4 << 45);
    if host_available().is_some() {
        let w = plan.host_warning().unwrap_or_default();
        assert!(w.contains("host memory") && w.contains("available"), "{w}");
    }
    let small = state_plan(
        &[vec![1000]],
        &precision,
        StatePlacement::Host,
        &ft_trainer::optim::adamw::SPEC,
        2,
        true,
    );
    assert!(small.host_warning().is_none());
    let cpu = state_plan(
        &[vec![1000]],
        &precision,
        StatePlacement::Host,
        &ft_trainer::optim::adamw::SPEC,
        2,
        false,
    );
    assert_eq!((cpu.host_bytes(), cpu.device_bytes()), (0, 20_000));
    // One micro-batch a step: no fp32 sums; offloaded, its bf16 gradients cross to the host.
    let one = |placement, gpu| {
        state_plan(
            &[vec![1000]],
            &precision,
            placement,
            &ft_trainer::optim::adamw::SPEC,
            1,
            gpu,
        )
    };
    let near = one(StatePlacement::WithModel, true);
    assert_eq!((near.device_bytes(), near.host_bytes()), (16_000, 0));
    let off = one(StatePlacement::Host, true);
    assert_eq!((off.device_bytes(), off.host_bytes()), (4_000, 14_000));
    let cpu = one(StatePlacement::Host, false);
    assert_eq!((cpu.device_bytes(), cpu.host_bytes()), (16_000, 0));
}

/// Under `--fused-backward` the plan's gradients are those alive at once: the parameters outside
/// every checkpoint segment and the largest segment (a tensor in two segments is kept to the end
/// of the backward, so it counts as outside; one named twice in a segment counts once; frozen
/// ones not at all), on a shapes-only model as on a loaded one; offloaded, the gradients moved
/// to the host are bounded the same way.
#[test]
fn fused_backward_plan_holds_the_outside_and_the_largest_segment() -> anyhow::Result<()> {
    use ft_params::{Init, ParamBuilder, ParamStore, Segments};
    use ft_trainer::train::plan::state_plan;
    for shapes_only in [false, true] {
        let store = ParamStore::new();
        let mut pb = ParamBuilder::new(store.clone(), DType::BF16, &Device::Cpu, 0);
        if shapes_only {
            pb = pb.shapes_only();
        }
        pb.get(&[100, 8], "embed", Init::Zeros)?; // outside every segment: 800
        let a = pb.get(&[8, 8], "a", Init::Zeros)?; // 64
        let b = pb.get(&[8, 16], "b", Init::Zeros)?; // 128
        let shared = pb.get(&[100], "shared", Init::Zeros)?; // in two segments: outside, 100
        let frozen = pb.clone().frozen().get(&[1000], "frozen", Init::Zeros)?;
        // The shared tensor with the smaller segment: counted in it, the largest would be
        // a's 64 + 100 = 164 and the outside 800, 964 in all, below the 1,092 alive at once.
        let segments = vec![
            vec![a.clone(), shared.clone(), frozen.clone()],
            vec![b.clone(), b.clone()],
            vec![shared.clone()],
        ];
        let seg = store.segments(&segments);
        assert_eq!(
            seg,
            Segments {
                inside: 64 + 128,
                largest: 128,
                tensors: 2,
                own: vec![vec![vec![8, 8]], vec![vec![8, 16]], vec![]],
                outside: vec![vec![100, 8], vec![100]],
            },
            "shapes only {shapes_only}"
        );
        let plan = |placement, gpu| {
            state_plan(
                &store.shapes(true),
                &Precision::full_bf16(),
                placement,
                &ft_trainer::optim::adamw::SPEC,
                1,
                gpu,
            )
        };
        let full = plan(StatePlacement::WithModel, true);
        let fused = full
            .clone()
            .under_fused_backward(seg.clone(), &ft_trainer::optim::adamw::SPEC);
        // The gradients formed segment by segment are not taken back under the fused backward
        // (its gradient rows count what it holds at once), on a GPU as on the CPU.
        assert_eq!(fused.clone().formed_by_segment(&seg), fused);
        // 1,092 trainable values: 900 outside + 128 of the largest segment alive at once.
        assert_eq!(full.params, 1092);
        assert_eq!(
            full.device_bytes() - fused.device_bytes(),
            2 * (1092 - 1028)
        );
        let row = |p: &ft_trainer::train::plan::StatePlan| p.rows[1].clone();
        assert_eq!(row(&fused).bytes, 2 * 1028);
        assert!(row(&fused).component.contains("--fused-backward"));
        let off = plan(StatePlacement::Host, true)
            .under_fused_backward(seg.clone(), &ft_trainer::optim::adamw::SPEC);
        let moved: Vec<u64> = off
            .rows
            .iter()
            .filter(|r| r.component.contains("gradients"))
            .map(|r| r.bytes)
            .collect();
        assert_eq!(moved, vec![2 * 1028, 2 * 1028], "{}", off.table());
        // With accumulation (--fused-backward --accum 16): the fp32 sums are whole, one
        // micro-batch's gradients alive at once are bounded as without it.
        let acc = state_plan(
            &store.shapes(true),
            &Precision::full_bf16(),
            StatePlacement::WithModel,
            &ft_trainer::optim::adamw::SPEC,
            16,
            true,
        )
        .under_fused_backward(seg.clone(), &ft_trainer::optim::adamw::SPEC);
        let bytes = |what: &str| {
            acc.rows
                .iter()
                .find(|r| r.component.contains(what))
                .map(|r| r.bytes)
        };
        assert_eq!(bytes("one micro-batch's gradients"), Some(2 * 1028));
        assert_eq!(bytes("gradient sums (fp32"), Some(4 * 1092));
        // With two, the accumulator holds the first one's bf16 gradients, and each fp32 sum
        // is stepped as it forms: never every sum at once.
        let two = state_plan(
            &store.shapes(true),
            &Precision::full_bf16(),
            StatePlacement::WithModel,
            &ft_trainer::optim::adamw::SPEC,
            2,
            true,
        )
        .under_fused_backward(seg.clone(), &ft_trainer::optim::adamw::SPEC);
        assert_eq!(acc.device_bytes() - two.device_bytes(), 2 * 1092);
        // One process adding the second's whole gradients after its backward: the first
        // one's bf16 gradients, then fp32 sums in place of both (2 + 2 bytes a value); a third
        // micro-batch's backward runs beside the fp32 sums. With the sums on the host of a GPU
        // run, the host holds both micro-batches' gradients at once: unchanged.
        let after = |accum, placement, gpu| {
            state_plan(
                &store.shapes(true),
                &Precision::full_bf16(),
                placement,
                &ft_trainer::optim::adamw::SPEC,
                accum,
                gpu,
            )
            .added_after_backward()
        };
        let bytes = |p: ft_trainer::train::plan::StatePlan| p.device_bytes() + p.host_bytes();
        let cpu = |accum| bytes(after(accum, StatePlacement::WithModel, false));
        assert_eq!(cpu(3) - cpu(2), 2 * 1092);
        let host = |accum| bytes(after(accum, StatePlacement::Host, true));
        assert_eq!(host(3), host(2));
        assert_eq!(
            fused.device_bytes() + 4 * 1092,
            acc.device_bytes(),
            "{}",
            acc.table()
        );
    }
    Ok(())
}

/// ZeRO's plan of one rank: the optimizer state of the rank that owns the most of it, and under
/// stage 2 the fp32 sums of its parameters' gradients alone; the rest stays whole.
#[test]
fn plan_per_rank_counts_the_largest_share() {
    use ft_trainer::train::plan::state_plan;
    let precision = Precision::for_dtype(DType::BF16);
    // Largest first to the emptier rank: 10 and 4 to rank 0, 8 and 6 to rank 1 (14 each);
    // as 3 ranks: 10, 8, 6 + 4 (the most: 10).
    let shapes = [vec![4usize], vec![8], vec![2, 5], vec![6]];
    let adamw = &ft_trainer::optim::adamw::SPEC;
    let plan = |accum, placement| state_plan(&shapes, &precision, placement, adamw, accum, true);
    let row = |p: &ft_trainer::train::plan::StatePlan, what: &str| {
        p.rows
            .iter()
            .filter(|r| r.component.contains(what))
            .map(|r| (r.bytes, r.on_host))
            .collect::<Vec<_>>()
    };
    let whole = plan(4, StatePlacement::WithModel);
    assert_eq!(whole.clone().per_rank(2, 0, &shapes, adamw), whole);
    assert_eq!(whole.clone().per_rank(1, 2, &shapes, adamw), whole);
    let z1 = whole.clone().per_rank(2, 1, &shapes, adamw);
    assert_eq!(row(&z1, "AdamW moments"), [(8 * 14, false)]);
    assert_eq!(row(&z1, "gradient sums"), [(4 * 28, false)]);
    // Each rank keeps its share of the masters.
    assert_eq!(row(&z1, "master weights"), [(4 * 14, false)]);
    let z2 = whole.clone().per_rank(3, 2, &shapes, adamw);
    assert_eq!(row(&z2, "AdamW moments"), [(8 * 10, false)]);
    assert_eq!(row(&z2, "gradient sums"), [(4 * 10, false)]);
    assert_eq!(row(&z2, "master weights"), [(4 * 10, false)]);
    // One micro-batch a step, offloaded: its bf16 gradients, then this rank's fp32 sums on
    // the host beside its state.
    let off = plan(1, StatePlacement::Host).per_rank(2, 2, &shapes, adamw);
    assert_eq!(row(&off, "gradient sums"), [(4 * 14, true)]);
    assert_eq!(row(&off, "AdamW moments"), [(8 * 14, true)]);
    assert_eq!(row(&off, "master weights"), [(4 * 14, true)]);
    assert_eq!(row(&off, "one micro-batch's gradients"), [(2 * 28, false)]);
    assert!(off.table().contains("ZeRO-2, 2 ranks"));
}

/// A data-parallel rank's plan counts what the sums over the ranks hold after backward: their
/// fp32 bucket (all 28 values here), the fp32 copy of the largest tensor (10 values) being
/// added when the gradients are bf16, and with one micro-batch a step the fp32 sums' excess
/// over the bf16 gradients (2 bytes a value): in host memory for a GPU run summing through
/// it, else with the step's temporaries on the device. Nothing for one process, under the
/// fused backward, or for fp32 sums of several micro-batches beyond the bucket.
#[test]
fn plan_counts_the_sums_over_the_ranks() {
    use ft_params::checkpoint::{ActivationProfile, Strategy};
    use ft_trainer::train::plan::state_plan;
    let precision = Precision::for_dtype(DType::BF16);
    let shapes = [vec![4usize], vec![8], vec![2, 5], vec![6]];
    let adamw = &ft_trainer::optim::adamw::SPEC;
    let plan =
        |accum, gpu| state_plan(&shapes, &precision, StatePlacement::Host, adamw, accum, gpu);
    let host_row = |p: &ft_trainer::train::plan::StatePlan| {
        p.rows
            .iter()
            .find(|r| r.component.contains("sums over 2 ranks in flight"))
            .map(|r| (r.bytes, r.on_host))
    };
    let through = plan(1, true).with_sums_in_flight(2, 0, 1, &shapes, false, true);
    assert_eq!(host_row(&through), Some((4 * 28 + 4 * 10 + 2 * 28, true)));
    // Several micro-batches: the fp32 sums are read as they are.
    let summed = plan(2, true).with_sums_in_flight(2, 0, 2, &shapes, false, true);
    assert_eq!(host_row(&summed), Some((4 * 28, true)));
    assert_eq!(
        host_row(&plan(1, true).with_sums_in_flight(1, 0, 1, &shapes, false, true)),
        None
    );
    // On the CPU the moment after backward holds them: the plan's total grows by them.
    let with = |p: ft_trainer::train::plan::StatePlan| {
        p.with_activations("nothing", &ActivationProfile::default(), Strategy::None)
            .device_bytes()
    };
    let cpu = |world| plan(1, false).with_sums_in_flight(world, 0, 1, &shapes, false, false);
    assert_eq!(with(cpu(2)) - with(cpu(1)), 4 * 28 + 4 * 10 + 2 * 28);
    // Several micro-batches on the CPU: the last one's bf16 gradients go into the step's sums
    // before the buckets fill, so the moment holds the bucket (28 fp32 values) less the
    // gradients freed (2 bytes a value), at least the largest tensor's fp32 sum (10 values).
    let acc = |world| plan(2, false).with_sums_in_flight(world, 0, 2, &shapes, false, false);
    assert_eq!(with(acc(2)) - with(acc(1)), 4 * 28 - 2 * 28);
    // ZeRO-2 on the CPU, one micro-batch a step: no accumulator, so the sums are no row held
    // all along; they arrive after backward, this rank's alone (14 values), each 2 bytes more
    // than the bf16 gradient it replaces. ZeRO-1's backward sums onto the owners alike.
    let zero = |stage: u8| {
        plan(1, false)
            .per_rank(2, stage, &shapes, adamw)
            .with_sums_in_flight(2, stage, 1, &shapes, false, false)
    };
    // Both stages keep the same shares of the state and masters.
    let z2 = zero(2);
    assert!(!z2
        .rows
        .iter()
        .any(|r| r.component.contains("gradient sums")));
    assert_eq!(with(zero(1)), with(z2));
    // ZeRO-2 with two micro-batches: the last one's sums arrive as with one, now beside the
    // accumulator of this rank's sums (14 fp32 values), which they are then added into.
    let z2_accum = plan(2, false)
        .per_rank(2, 2, &shapes, adamw)
        .with_sums_in_flight(2, 2, 2, &shapes, false, false);
    assert_eq!(with(z2_accum) - with(zero(2)), 4 * 14);
}

/// Four bf16 tensors of 4, 8, 10 and 6 values, the last two in one checkpoint segment.
fn four_tensors_two_in_a_segment() -> (Vec<Vec<usize>>, ft_params::Segments) {
    let seg = ft_params::Segments {
        inside: 16,
        largest: 16,
        tensors: 2,
        own: vec![vec![vec![2, 5], vec![6]]],
        outside: vec![vec![4], vec![8]],
    };
    (vec![vec![4], vec![8], vec![2, 5], vec![6]], seg)
}

/// An activation profile of segments whose kept graphs are `bytes`, in forward order.
fn graphs(bytes: &[u64]) -> ft_params::checkpoint::ActivationProfile {
    use ft_params::checkpoint::{ActivationProfile, SegmentBytes};
    ActivationProfile {
        segments: bytes
            .iter()
            .map(|&graph| SegmentBytes {
                graph,
                ..SegmentBytes::default()
            })
            .collect(),
        ..ActivationProfile::default()
    }
}

/// A data-parallel backward that sums each checkpoint segment's gradients over the ranks as the
/// segment ends (`update/reduce_backward.rs`): with several micro-batches a step, each round's
/// buffers stand at its segment's moment of the backward, beside the graphs still held; under
/// ZeRO-1 with two, the accumulator holds the first micro-batch's gradients or this rank's
/// sums, never every fp32 sum.
#[test]
fn plan_counts_the_rounds_in_segments_at_their_moments() {
    use ft_params::checkpoint::{ActivationProfile, Strategy};
    use ft_params::Segments;
    use ft_trainer::train::plan::{state_plan, StatePlan};
    let precision = Precision::for_dtype(DType::BF16);
    let (shapes, seg) = four_tensors_two_in_a_segment();
    let adamw = &ft_trainer::optim::adamw::SPEC;
    let reduced = |world, stage, accum| {
        state_plan(
            &shapes,
            &precision,
            StatePlacement::WithModel,
            adamw,
            accum,
            false,
        )
        .per_rank(world, stage, &shapes, adamw)
        .reduced_by_segment(world, stage, accum, &seg, &shapes)
        .with_sums_in_flight(world, stage, accum, &shapes, false, false)
    };
    let one_segment = graphs(&[1000]);
    let with = |p: StatePlan| {
        p.with_activations("one segment", &one_segment, Strategy::Blocks)
            .device_bytes()
    };
    // Two micro-batches under ZeRO-0: the segment's round (an fp32 bucket of its 16 values;
    // the fp32 sums are what it reads, no copies) beside its kept graph of 1,000, above the
    // backward's peak; after the backward, the rest's round (12 values) alone.
    let sums = |p: &StatePlan| {
        p.rows
            .iter()
            .find(|r| r.component.contains("gradient sums"))
            .map(|r| r.bytes)
    };
    assert_eq!(with(reduced(2, 0, 2)) - with(reduced(1, 0, 2)), 4 * 16);
    assert_eq!(sums(&reduced(2, 0, 2)), Some(4 * 28));
    // Under ZeRO-1 the first micro-batch's bf16 gradients (56 bytes), or this rank's fp32 sums
    // of its 14 values with the fp32 sums of the 12 values outside the segment formed at the
    // last round (104 bytes), not all 28 values' fp32 sums (112).
    assert_eq!(sums(&reduced(2, 1, 2)), Some(4 * 14 + 4 * 12));
    // One micro-batch on the CPU: the sums are counted where they have arrived. At the
    // segment's round its own (16 values, made while its bucket is held) beside its bucket
    // (16) and the fp32 copy of its largest bf16 tensor (10), and its graph; after the backward
    // all 28 values' sums, with the rest's round, on no graph.
    assert_eq!(
        with(reduced(2, 0, 1)) - with(reduced(1, 0, 1)),
        4 * 16 + 4 * 16 + 4 * 10
    );
    let no_graph = |p: StatePlan| {
        p.with_activations("nothing", &ActivationProfile::default(), Strategy::Blocks)
            .device_bytes()
    };
    assert_eq!(
        no_graph(reduced(2, 0, 1)) - no_graph(reduced(1, 0, 1)),
        4 * 28 + 4 * 16 + 4 * 10
    );
    assert!(!reduced(2, 0, 1)
        .rows
        .iter()
        .any(|r| r.component.contains("gradient sums")));
    // Two segments: by the first one's round (the backward's last), the sums of both
    // segments' 16 values (64 bytes), beside the first one's graph (1,000) and round (bucket
    // and copy of its 10 values, 80 bytes): 134 above the backward's peak of both graphs
    // (1,010). (And the bf16 gradients at most at once are the outside's 12 values and the
    // largest segment's 10, 6 fewer than all 28: 12 bytes less.)
    let two = Segments {
        inside: 16,
        largest: 10,
        tensors: 2,
        own: vec![vec![vec![2, 5]], vec![vec![6]]],
        outside: vec![vec![4], vec![8]],
    };
    let two_segments = graphs(&[1000, 10]);
    let in_two = |world| {
        state_plan(
            &shapes,
            &precision,
            StatePlacement::WithModel,
            adamw,
            1,
            false,
        )
        .reduced_by_segment(world, 0, 1, &two, &shapes)
        .with_sums_in_flight(world, 0, 1, &shapes, false, false)
        .with_activations("two segments", &two_segments, Strategy::Blocks)
        .device_bytes()
    };
    assert_eq!(
        in_two(2) - in_two(1),
        1000 + 4 * 10 + 4 * 10 + 4 * 16 - 1010 - 2 * 6
    );
}

/// Under the fused backward across ranks the plan counts each round of the sums over the ranks
/// (`update/fused_backward.rs`): its fp32 bucket (a segment's 16 values here, or the rest's
/// 12), the fp32 copy of its largest bf16 tensor being added (10 or 8 values) and, with one
/// micro-batch a step, the fp32 sums arriving, which the segment's step reads: in host memory
/// for a GPU run summing through it (a row of the largest round), else at the segments'
/// moments of the backward (on the CPU the sums replace the bf16 gradients: 2 bytes a value
/// more). Under ZeRO the sums arriving are at most this rank's share (14 values).
#[test]
fn plan_counts_the_fused_backwards_rounds() {
    use ft_params::checkpoint::{ActivationProfile, Strategy};
    use ft_trainer::train::plan::{state_plan, StatePlan};
    let precision = Precision::for_dtype(DType::BF16);
    let (shapes, seg) = four_tensors_two_in_a_segment();
    let adamw = &ft_trainer::optim::adamw::SPEC;
    let fused = |accum, gpu| {
        state_plan(&shapes, &precision, StatePlacement::Host, adamw, accum, gpu)
            .under_fused_backward(seg.clone(), adamw)
    };
    let host_row = |p: &StatePlan| {
        p.rows
            .iter()
            .find(|r| r.component.contains("a segment's round at a time"))
            .map(|r| (r.bytes, r.on_host))
    };
    let through = |world, stage, accum| {
        fused(accum, true)
            .rounds_under_fused_backward(world, stage, accum, &seg, &shapes, false, true)
    };
    assert_eq!(
        host_row(&through(2, 0, 1)),
        Some((4 * 16 + 4 * 10 + 4 * 16, true))
    );
    assert_eq!(
        host_row(&through(2, 1, 1)),
        Some((4 * 16 + 4 * 10 + 4 * 14, true))
    );
    // Several micro-batches: the sums arriving take the place of the step's own.
    assert_eq!(host_row(&through(2, 0, 2)), Some((4 * 16 + 4 * 10, true)));
    assert_eq!(host_row(&through(1, 0, 1)), None);
    // On the CPU, with no segments in the profile, the moment after the backward holds the
    // rest's round (AdamW's step makes no temporaries): bucket, copy and the sums' excess.
    let with = |p: StatePlan| {
        p.with_activations("nothing", &ActivationProfile::default(), Strategy::Blocks)
            .device_bytes()
    };
    let cpu = |world| {
        fused(1, false).rounds_under_fused_backward(world, 0, 1, &seg, &shapes, false, false)
    };
    assert_eq!(with(cpu(2)) - with(cpu(1)), 4 * 12 + 4 * 8 + 2 * 12);
    // With the segment in the profile, its round (bucket 64, copy 40, the sums' excess 32)
    // stands at its moment of the backward, beside its kept graph of 1,000: above the rest's.
    let one_segment = graphs(&[1000]);
    let with_segment = |p: StatePlan| {
        p.with_activations("one segment", &one_segment, Strategy::Blocks)
            .device_bytes()
    };
    assert_eq!(
        with_segment(cpu(2)) - with_segment(cpu(1)),
        4 * 16 + 4 * 10 + 2 * 16
    );
    assert!(cpu(2)
        .with_activations("nothing", &ActivationProfile::default(), Strategy::Blocks)
        .table()
        .contains("a round of the gradients' sums over the ranks"));
}
