//! `cargo run --release -p ft-kernels --example activation_bench`: forward and forward + backward
//! time of `ft_kernels::activation` (GELU tanh, SiLU, exact GELU) and of `ft_kernels::gated`
//! (GEGLU, T5's gated GELU) on f32 CPU tensors, one chunk (on the calling thread) to several
//! (rayon's threads): the measurement behind `ft_kernels::fastmath` and the `wide` loops.

use std::time::Instant;

use candle_core::{Device, Result, Tensor, Var};
use ft_kernels::activation::{activate, Activation};
use ft_kernels::gated::{gated, gated_halves};

fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    let t0 = Instant::now();
    for _ in 0..reps {
        f()?;
    }
    Ok(t0.elapsed().as_secs_f64() / reps as f64 * 1e3)
}

fn main() -> Result<()> {
    ft_kernels::threads::run(bench)
}

fn bench() -> Result<()> {
    println!("f32, CPU, ms per call (mean after a warm-up)\n");
    println!("| activation | elements | forward | forward + backward |");
    println!("|---|---|---|---|");
    for act in [Activation::GeluTanh, Activation::Silu, Activation::GeluErf] {
        for n in [1usize << 16, 1 << 20, 1 << 23] {
            let reps = (1 << 26) / n;
            let x = Var::from_tensor(&Tensor::randn(0f32, 2., n, &Device::Cpu)?)?;
            let g = Tensor::randn(0f32, 1., n, &Device::Cpu)?;
            let f = time(reps, || activate(x.as_tensor(), act).map(|_| ()))?;
            let fb = time(reps, || {
                let y = activate(x.as_tensor(), act)?;
                (y * &g)?.sum_all()?.backward().map(|_| ())
            })?;
            println!("| {act:?} | {n} | {f:.3} | {fb:.3} |");
        }
    }
    // The gated forms (`ft_kernels::gated`), `n` outputs each: diffusers' GEGLU (the exact
    // GELU of one projection's second half times its first, rows of 2 x 1024) and T5's
    // `gelu_new(gate) * value` of two tensors.
    for n in [1usize << 16, 1 << 20] {
        let reps = (1 << 26) / n;
        let randn = |shape: &[usize]| Tensor::randn(0f32, 2., shape, &Device::Cpu);
        let h = Var::from_tensor(&randn(&[n / 1024, 2048])?)?;
        let (gate, value) = (Var::from_tensor(&randn(&[n])?)?, randn(&[n])?);
        let g = Tensor::randn(0f32, 1., n, &Device::Cpu)?;
        let geglu = || gated_halves(h.as_tensor(), Activation::GeluErf)?.flatten_all();
        let t5 = || gated(gate.as_tensor(), &value, Activation::GeluTanh);
        for (name, op) in [
            ("GEGLU (exact GELU)", &geglu as &dyn Fn() -> Result<Tensor>),
            ("T5 gated GELU-tanh", &t5),
        ] {
            let f = time(reps, || op().map(|_| ()))?;
            let fb = time(reps, || (op()? * &g)?.sum_all()?.backward().map(|_| ()))?;
            println!("| {name} | {n} | {f:.3} | {fb:.3} |");
        }
    }
    Ok(())
}
