//! The plain backward across ranks summing each checkpoint segment's gradients in rounds
//! (`MixedOptimizer::backward_and_reduce_across`), on 2 ranks started by `mpirun` (the test
//! starts it on its own executable; each rank runs `rank_body`), where a tensor's gradient
//! depends on the data: one rank's last micro-batch gives it none while its earlier one did,
//! and the other rank's last gives one. That rank's sum of the earlier micro-batch goes into
//! the round in which the other rank offers the tensor (not a round of its own after the
//! backward, which the rounds refuse as a tensor summed twice), and the sums over the ranks are
//! those of every micro-batch of both ranks. Needs the `mpi` feature and an `mpirun` on PATH:
//! without one the test says so and passes, unless `FT_REQUIRE_MPI=1` (CI) makes that a
//! failure.
#![cfg(feature = "mpi")]

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use ft_params::checkpoint::{Checkpointer, SegmentFn, Strategy};
use ft_trainer::optim::Sgd;
use ft_trainer::update::{
    BackwardRanks, GradAccumulator, MixedOptimizer, Precision, StatePlacement,
};

mod common;
use common::{layer_fn, named_params, stack_of, Layer};

#[path = "../../dist/tests/common/mod.rs"]
mod ranks;

const WIDTH: usize = 8;

/// Whether micro-batch `micro` of rank `rank` reads the gate: all but rank 1's last.
fn reads_gate(rank: usize, micro: usize) -> bool {
    !(rank == 1 && micro == 1)
}

/// A layer that adds `gate` to its input when told to: its segment's other tensors get a
/// gradient either way, the gate only from the micro-batches that read it.
fn gated(l: &Layer, gate: &Tensor, reads: bool) -> SegmentFn {
    let inner = layer_fn(l);
    let gate = gate.clone();
    Arc::new(move |xs: &[Tensor]| {
        let x = if reads {
            xs[0].broadcast_add(&gate)?
        } else {
            xs[0].clone()
        };
        inner(&[x])
    })
}

/// Micro-batch `micro` of rank `rank`'s loss through three checkpointed layers, the middle
/// one gated.
fn loss(
    ck: &Checkpointer,
    layers: &[Layer],
    gate: &Var,
    rank: usize,
    micro: usize,
) -> anyhow::Result<Tensor> {
    let x = (Tensor::arange(0f32, (3 * WIDTH) as f32, &Device::Cpu)?.reshape((3, WIDTH))?
        * (0.1 + 0.7 * rank as f64 + 0.3 * micro as f64))?
        .sin()?;
    ck.begin_forward();
    let mut h = x;
    for (i, l) in layers.iter().enumerate() {
        let mut params = l.params.clone();
        let f = if i == 1 {
            params.push(gate.clone());
            gated(l, gate.as_tensor(), reads_gate(rank, micro))
        } else {
            layer_fn(l)
        };
        h = ck.run(f, &[&h], &params)?;
    }
    Ok((h.sqr()?.sum_all()? / 12.0)?)
}

/// This rank's model (three layers, the gate), its optimizer (SGD without momentum), and the
/// gradients one process gets from the four micro-batches of both ranks.
struct Setup {
    rank: usize,
    layers: Vec<Layer>,
    gate: Var,
    params: Vec<Var>,
    opt: MixedOptimizer,
    want: Vec<Tensor>,
}

fn setup() -> anyhow::Result<Setup> {
    let comm = ft_trainer::train::ranks::world()?;
    let (rank, world) = (comm.rank(), comm.world());
    assert_eq!(world, 2, "started outside mpirun -np 2");
    let (_store, layers) = stack_of(DType::F32, 3, WIDTH)?;
    let gate = Var::from_tensor(&Tensor::full(0.2f32, WIDTH, &Device::Cpu)?)?;
    let mut named = named_params(&layers);
    named.push(("gate".into(), gate.clone()));
    let params: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
    let opt = MixedOptimizer::new(
        named,
        Precision::for_dtype(DType::F32),
        StatePlacement::WithModel,
        |n| Box::new(Sgd::new(n, 0.0, 0.0, false)),
        None,
    )?;
    let plain = Checkpointer::with_strategy(Strategy::None);
    let mut want: Vec<Option<Tensor>> = vec![None; params.len()];
    for r in 0..world {
        for m in 0..2 {
            let grads = plain.gradients(&loss(&plain, &layers, &gate, r, m)?, &params)?;
            for (w, g) in want.iter_mut().zip(grads) {
                *w = match (w.take(), g) {
                    (Some(a), Some(b)) => Some((a + b)?),
                    (a, b) => a.or(b),
                };
            }
        }
    }
    let want = want
        .into_iter()
        .map(|w| w.ok_or_else(|| anyhow::anyhow!("a tensor without a gradient")))
        .collect::<anyhow::Result<_>>()?;
    Ok(Setup {
        rank,
        layers,
        gate,
        params,
        opt,
        want,
    })
}

/// How this step's backward meets the other rank.
fn ranks() -> BackwardRanks {
    BackwardRanks {
        comm: ft_trainer::train::ranks::world,
        device: Device::Cpu,
        step: 1,
    }
}

/// `got` against `want`, tensor by tensor, within f32 rounding of the sums' order.
fn close(rank: usize, what: &str, got: &[Tensor], want: &[Tensor]) -> anyhow::Result<()> {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let diff = (g - w)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = w.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            diff <= 1e-5 * scale.max(1.0),
            "rank {rank}: {what} {i} differs by {diff}"
        );
    }
    Ok(())
}

/// Micro-batch 0's backward in checkpoint segments, its gradients in the step's sums; then
/// micro-batch 1's forward: the checkpointer, the sums and micro-batch 1's loss.
fn earlier_and_last(s: &Setup) -> anyhow::Result<(Checkpointer, GradAccumulator, Tensor)> {
    let ck = Checkpointer::with_strategy(Strategy::Blocks);
    let mut sums = GradAccumulator::new();
    let first = loss(&ck, &s.layers, &s.gate, s.rank, 0)?;
    s.opt.backward_and_accumulate(&ck, &first, &mut sums)?;
    let last = loss(&ck, &s.layers, &s.gate, s.rank, 1)?;
    Ok((ck, sums, last))
}

/// One rank, the plain backward: micro-batch 0 accumulated, micro-batch 1 summed over the
/// ranks segment by segment; the sums against one process's gradients.
#[test]
#[ignore = "run by each rank under mpirun: see a_gradient_only_some_ranks_give_is_summed_in_one_round"]
fn rank_body() -> anyhow::Result<()> {
    let mut s = setup()?;
    let (ck, mut sums, last) = earlier_and_last(&s)?;
    s.opt
        .backward_and_reduce_across(&ck, Some(last), &mut sums, &ranks())?;
    let got = sums
        .take()
        .into_iter()
        .map(|g| g.ok_or_else(|| anyhow::anyhow!("rank {}: a sum missing", s.rank)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    close(s.rank, "sum", &got, &s.want)?;
    ranks::finished(s.rank)
}

/// One rank, the fused backward: micro-batch 0 accumulated, each segment of micro-batch 1
/// summed over the ranks and stepped (SGD, lr 0.1, no clipping); the weights against one
/// process's step from the same gradients.
#[test]
#[ignore = "run by each rank under mpirun: see a_gradient_only_some_ranks_give_is_summed_in_one_round"]
fn fused_rank_body() -> anyhow::Result<()> {
    let mut s = setup()?;
    let before: Vec<Tensor> = s
        .params
        .iter()
        .map(|p| p.as_tensor().copy())
        .collect::<Result<_, _>>()?;
    let (ck, mut sums, last) = earlier_and_last(&s)?;
    s.opt
        .backward_and_step_across(&ck, Some(&last), 0.1, &mut sums, &ranks())?;
    let got: Vec<Tensor> = s.params.iter().map(|p| p.as_tensor().clone()).collect();
    let want = before
        .iter()
        .zip(&s.want)
        .map(|(w, g)| Ok((w - (g * 0.1)?)?))
        .collect::<anyhow::Result<Vec<_>>>()?;
    close(s.rank, "weight", &got, &want)?;
    ranks::finished(s.rank)
}

#[test]
fn a_gradient_only_some_ranks_give_is_summed_in_one_round() -> anyhow::Result<()> {
    ranks::ranks_run(2, "rank_body")?;
    ranks::ranks_run(2, "fused_rank_body")?;
    Ok(())
}
