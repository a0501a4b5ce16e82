//! The fused backward pass with gradient accumulation (`--fused-backward --accum N`): on every
//! micro-batch but the last each segment's gradients go into the step's sums as its backward
//! ends, on the last each parameter steps from its sum plus its last gradient. Without clipping
//! the weights equal plain accumulated training (`checkpointer.gradients`, `GradAccumulator::add`,
//! `step`) bit for bit, for each optimizer, with fp32 masters or without, with the state on the
//! host or beside the model. With clipping, each tensor is clipped by the norm of its own summed
//! gradient (the fused backward's per-tensor rule).

use candle_core::{DType, Device, Tensor, Var};
use ft_params::checkpoint::Checkpointer;
use ft_trainer::optim::adafactor::{Adafactor, AdafactorConfig};
use ft_trainer::optim::adamw8bit::AdamW8bit;
use ft_trainer::optim::{AdamW, AdamWConfig, Optimizer, Sgd};
use ft_trainer::update::{GradAccumulator, MixedOptimizer, Precision, StatePlacement};

mod common;
use common::{bits, layer_fn, named_params, stack_of, Layer};

type MakeOpt = fn(usize) -> Box<dyn Optimizer>;

const MICRO: usize = 3;
const STEPS: usize = 3;

/// The model: a stack of checkpointed layers, a head weight outside every segment, and a bias
/// only the step's first micro-batch uses (so the last one gives it no gradient).
struct Model {
    layers: Vec<Layer>,
    head: Var,
    first_only: Var,
}

impl Model {
    fn new(dtype: DType) -> anyhow::Result<(Model, Vec<(String, Var)>)> {
        let (_store, layers) = stack_of(dtype, 4, 16)?;
        let head = Var::from_tensor(
            &(Tensor::arange(0f32, 16.0, &Device::Cpu)?.reshape((16, 1))? * 0.05)?
                .cos()?
                .to_dtype(dtype)?,
        )?;
        let first_only =
            Var::from_tensor(&Tensor::full(0.1f32, 16, &Device::Cpu)?.to_dtype(dtype)?)?;
        let mut named = named_params(&layers);
        named.push(("head".into(), head.clone()));
        named.push(("first_only".into(), first_only.clone()));
        Ok((
            Model {
                layers,
                head,
                first_only,
            },
            named,
        ))
    }

    /// Micro-batch `micro` of step `step`'s share of the step's mean loss.
    fn loss(&self, ck: &Checkpointer, step: usize, micro: usize) -> anyhow::Result<Tensor> {
        let dtype = self.head.dtype();
        let x = (Tensor::arange(0f32, 48.0, &Device::Cpu)?.reshape((3, 16))?
            * (0.1 + step as f64 + 0.37 * micro as f64))?
            .sin()?
            .to_dtype(dtype)?;
        let x = if micro == 0 {
            x.broadcast_add(self.first_only.as_tensor())?
        } else {
            x
        };
        ck.begin_forward();
        let mut h = x;
        for l in &self.layers {
            h = ck.run(layer_fn(l), &[&h], &l.params)?;
        }
        let out = h.matmul(self.head.as_tensor())?.to_dtype(DType::F32)?;
        Ok((out.sqr()?.sum_all()? / (3 * MICRO) as f64)?)
    }
}

/// The weights' bits after `STEPS` steps of `MICRO` micro-batches, fused or plain.
fn train(
    make: MakeOpt,
    precision: Precision,
    placement: StatePlacement,
    fused: bool,
    clip: Option<f64>,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let (model, named) = Model::new(precision.storage)?;
    let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
    let mut opt = MixedOptimizer::new(named, precision, placement, make, clip)?;
    let ck = Checkpointer::new(true);
    let mut acc = match placement {
        StatePlacement::Host => GradAccumulator::on(&Device::Cpu),
        StatePlacement::WithModel => GradAccumulator::new(),
    };
    let lr = 1e-2;
    for step in 0..STEPS {
        for micro in 0..MICRO {
            let loss = model.loss(&ck, step, micro)?;
            if !fused {
                acc.add(ck.gradients(&loss, &vars)?)?;
            } else if micro + 1 < MICRO {
                let taken = opt.backward_and_accumulate(&ck, &loss, &mut acc)?;
                assert_eq!(taken, 8, "the four layers' weights and biases, in backward");
                assert_eq!(acc.micro_batches(), micro + 1);
            } else {
                let out = opt.backward_and_step(&ck, &loss, lr, &mut acc)?;
                assert_eq!(out.updated_in_backward, 8);
                assert_eq!(acc.micro_batches(), 0, "the sums are spent");
                assert_eq!(acc.bytes(), 0);
                // The next step's sums stay where the run put them (the host, offloaded).
                assert_eq!(
                    acc.pinned().map(|d| d.is_cpu()),
                    (placement == StatePlacement::Host).then_some(true),
                    "the accumulator keeps its device across a fused step"
                );
            }
        }
        if !fused {
            opt.step(acc.take(), lr)?;
        }
    }
    assert_eq!(
        opt.optimizer().state().0,
        STEPS as u64,
        "one count per step"
    );
    vars.iter()
        .chain(opt.masters())
        .map(|v| Ok(bits(v.as_tensor())?))
        .collect()
}

fn optimizers() -> Vec<(&'static str, MakeOpt)> {
    vec![
        ("adamw", |n| Box::new(AdamW::new(n, AdamWConfig::default()))),
        ("adamw8bit", |n| {
            Box::new(AdamW8bit::new(n, AdamWConfig::default()))
        }),
        ("adafactor", |n| {
            Box::new(Adafactor::new(n, AdafactorConfig::paper()))
        }),
        ("sgd", |n| Box::new(Sgd::new(n, 0.9, 0.01, false))),
    ]
}

#[test]
fn fused_accumulation_equals_plain_accumulation_bit_for_bit() -> anyhow::Result<()> {
    let precisions = [
        ("f32", Precision::parse("f32")?),
        ("bf16 + fp32 masters", Precision::parse("bf16")?),
    ];
    for (name, make) in optimizers() {
        for (pname, precision) in precisions {
            for placement in [StatePlacement::WithModel, StatePlacement::Host] {
                let plain = train(make, precision, placement, false, None)?;
                let fused = train(make, precision, placement, true, None)?;
                assert!(
                    fused == plain,
                    "{name}, {pname}, {placement:?}: fused accumulation differs from plain"
                );
            }
        }
    }
    Ok(())
}

/// With clipping at `max`, plain SGD: each tensor moves by `-lr * min(1, max / (||s|| + 1e-6)) * s`
/// where `s` is its gradient summed over the step's micro-batches (computed here by plain
/// backward and accumulation at the current weights).
#[test]
fn fused_accumulation_clips_each_summed_tensor_by_its_own_norm() -> anyhow::Result<()> {
    let (lr, max) = (1e-2, 3.0);
    let sgd: MakeOpt = |n| Box::new(Sgd::new(n, 0.0, 0.0, false));
    let (model, named) = Model::new(DType::F32)?;
    let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
    let precision = Precision::parse("f32")?;
    let mut opt = MixedOptimizer::new(named, precision, StatePlacement::WithModel, sgd, Some(max))?;
    let ck = Checkpointer::new(true);
    let (mut clipped, mut total) = (0, 0);
    for step in 0..2 {
        let mut reference = GradAccumulator::new();
        for micro in 0..MICRO {
            reference.add(ck.gradients(&model.loss(&ck, step, micro)?, &vars)?)?;
        }
        let mut want = Vec::new();
        for (v, s) in vars.iter().zip(reference.take()) {
            let s = s.ok_or_else(|| anyhow::anyhow!("no gradient"))?;
            let norm = s.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            let coef = (max / (norm.sqrt() + 1e-6)).min(1.0);
            clipped += usize::from(coef < 1.0);
            total += 1;
            want.push((v.as_tensor() - (s * (lr * coef))?)?);
        }
        let mut acc = GradAccumulator::new();
        for micro in 0..MICRO {
            let loss = model.loss(&ck, step, micro)?;
            if micro + 1 < MICRO {
                opt.backward_and_accumulate(&ck, &loss, &mut acc)?;
            } else {
                opt.backward_and_step(&ck, &loss, lr, &mut acc)?;
            }
        }
        for (i, (v, w)) in vars.iter().zip(&want).enumerate() {
            let d = (v.as_tensor() - w)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(d < 1e-6, "step {step}, tensor {i}: off by {d}");
        }
    }
    assert!(
        clipped > 0 && clipped < total,
        "{clipped} of {total} updates clipped: some should be, not all"
    );
    Ok(())
}
