//! Times the fused linear cross-entropy (forward with its gradients, then backward) on the CPU
//! at the t5-small-sized bench's head (256 rows of 512, vocabulary 32,128), with logits of
//! spread ~1 and ~23: the second gives most probabilities below f32's smallest normal value, the
//! case a trained head is in. Before those were written as 0 (docs/benchmarks.md, #21) the
//! second took ten times the first.
//!
//! `cargo run --release -p ft-kernels --example time_cross_entropy`

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};
use ft_kernels::cross_entropy::linear_cross_entropy;

fn main() -> Result<()> {
    ft_kernels::threads::run(|| {
        let dev = Device::Cpu;
        ft_kernels::matmul_scratch::warm_all_threads();
        let h = Var::randn(0f32, 1.0, (256, 512), &dev)?;
        let labels = Tensor::arange(0u32, 256, &dev)?.to_dtype(DType::I64)?;
        for w_std in [0.05f32, 1.0] {
            let w = Var::randn(0f32, w_std, (32128, 512), &dev)?;
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let t = Instant::now();
                let loss = linear_cross_entropy(h.as_tensor(), w.as_tensor(), &labels)?;
                loss.backward()?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "linear cross-entropy, 256 x 512 -> 32128, logits' spread {:.0}: {:.3} s (best of 3)",
                w_std * 512f32.sqrt(),
                best
            );
        }
        Ok(())
    })
}
