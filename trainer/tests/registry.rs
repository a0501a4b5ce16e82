//! The optimizer registry: every optimizer `--optim` names builds, steps, plans exactly the
//! state it keeps, and checkpoints it; names resolve case-insensitively through their aliases.

use candle_core::{DType, Device, Tensor, Var};
use ft_trainer::optim::registry::{find, REGISTRY};
use ft_trainer::optim::OptimSettings;
use ft_trainer::train::plan::state_plan;
use ft_trainer::update::{Precision, StatePlacement};

/// Parameters of shapes the optimizers treat differently: a matrix (factored by Adafactor,
/// 8-bit above 4,096 values), a convolution, a small vector.
fn params() -> anyhow::Result<Vec<Var>> {
    let shapes: [&[usize]; 3] = [&[96, 80], &[8, 4, 3, 3], &[10]];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n: usize = s.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|j| ((j * 7 + i) % 13) as f32 / 13.0 - 0.5)
                .collect();
            Ok(Var::from_tensor(&Tensor::from_vec(v, *s, &Device::Cpu)?)?)
        })
        .collect()
}

fn grads(ps: &[Var], scale: f32) -> anyhow::Result<Vec<Option<Tensor>>> {
    ps.iter()
        .map(|p| {
            Ok(Some(
                (p.as_tensor().sin()? * scale as f64)?.to_dtype(DType::F32)?,
            ))
        })
        .collect()
}

#[test]
fn every_registered_optimizer_steps_plans_its_state_and_checkpoints_it() -> anyhow::Result<()> {
    let settings = OptimSettings { weight_decay: 0.01 };
    for spec in REGISTRY {
        let name = spec.name();
        let ps = params()?;
        let before: Vec<Vec<f32>> = ps
            .iter()
            .map(|p| p.as_tensor().flatten_all()?.to_vec1())
            .collect::<candle_core::Result<_>>()?;
        let mut opt = (spec.build)(ps.len(), &settings);
        assert_eq!(opt.n_params(), ps.len(), "{name}");
        opt.step(&ps, &grads(&ps, 0.5)?, 1e-2)?;
        for (p, b) in ps.iter().zip(&before) {
            let after: Vec<f32> = p.as_tensor().flatten_all()?.to_vec1()?;
            assert_ne!(&after, b, "{name}: a parameter did not move");
        }
        // The plan's bytes for this optimizer are the bytes it holds after a step.
        let shapes: Vec<Vec<usize>> = ps.iter().map(|p| p.dims().to_vec()).collect();
        let plan = state_plan(
            &shapes,
            &Precision::for_dtype(DType::F32),
            StatePlacement::WithModel,
            spec,
            1,
            false,
        );
        let row = plan
            .rows
            .iter()
            .find(|r| r.component == spec.state_label)
            .ok_or_else(|| anyhow::anyhow!("{name}: no plan row"))?;
        assert_eq!(
            row.bytes,
            opt.state_bytes(),
            "{name}: planned vs held state"
        );
        // Its state restored into a fresh one steps the same as the original.
        let (t, state) = opt.state();
        let saved: Vec<(String, Tensor)> = state
            .iter()
            .map(|(n, x)| Ok((n.clone(), x.copy()?)))
            .collect::<candle_core::Result<_>>()?;
        let ps2: Vec<Var> = ps
            .iter()
            .map(|p| Var::from_tensor(&p.as_tensor().copy()?))
            .collect::<candle_core::Result<_>>()?;
        let mut again = (spec.build)(ps.len(), &settings);
        again.load_state(t, &saved)?;
        opt.step(&ps, &grads(&ps, -0.25)?, 1e-2)?;
        again.step(&ps2, &grads(&ps2, -0.25)?, 1e-2)?;
        for (a, b) in ps.iter().zip(&ps2) {
            let (a, b): (Vec<f32>, Vec<f32>) = (
                a.as_tensor().flatten_all()?.to_vec1()?,
                b.as_tensor().flatten_all()?.to_vec1()?,
            );
            assert_eq!(a, b, "{name}: a restored optimizer steps otherwise");
        }
    }
    Ok(())
}

#[test]
fn names_and_aliases_resolve_and_an_unknown_name_lists_the_registry() -> anyhow::Result<()> {
    for spec in REGISTRY {
        for alias in spec.names {
            assert_eq!(find(alias)?.name(), spec.name());
            assert_eq!(find(&alias.to_ascii_uppercase())?.name(), spec.name());
        }
    }
    assert_eq!(find("adamw_bnb_8bit")?.name(), "adamw8bit");
    let e = find("lion").unwrap_err().to_string();
    for spec in REGISTRY {
        assert!(e.contains(spec.name()), "{e}");
    }
    Ok(())
}
