//! Times the fused attention kernels (`src/cuda/attention.cu`, and in bf16 on sm_80+ the
//! tensor-core ones of `attention_tc.cu`) at SDXL's and T5's shapes, forward and forward +
//! backward, next to `sdpa` (the score-matrix reference) where it fits. Each shape is first
//! checked against `sdpa` on the same GPU. `FT_ATTENTION_TC=0` times the CUDA-core kernels in
//! bf16 too. ft-trainer's `gpu_bench attention` gives the same rows beside PyTorch's SDPA.
//!
//! `cargo run --release --features cuda -p ft-kernels --example time_attention`

use candle_core::{DType, Result, Tensor, Var};
use ft_kernels::attention::sdpa;
use ft_kernels::cuda::check::{gpu, max_rel_diff, report, time_us};
use ft_kernels::cuda::fused_attention;
use ft_kernels::gradcheck::random_tensor;

fn main() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    // [B, H, Lq, Lk]: SDXL self-attention at 1024 px (4096 tokens of 10 heads) and 512 px,
    // cross-attention (77 keys), FLAN-T5-XL (32 heads, 512 tokens, batch 8).
    for (b, h, lq, lk) in [
        (1, 10, 4096, 4096),
        (1, 10, 1024, 1024),
        (1, 10, 4096, 77),
        (8, 32, 512, 512),
    ] {
        for dt in [DType::F32, DType::BF16] {
            let r = |shape: [usize; 4], seed| -> Result<Tensor> {
                random_tensor(&shape, seed, &dev)?.to_dtype(dt)
            };
            let q = r([b, h, lq, 64], 5)?;
            let k = r([b, h, lk, 64], 6)?;
            let v = r([b, h, lk, 64], 7)?;
            let scale = 0.125;
            let want = sdpa(&q, &k, &v, None, scale)?;
            let got = fused_attention(&q, &k, &v, None, scale)?;
            let err = max_rel_diff(&got, &want)?;
            let tol = if dt == DType::F32 { 1e-4 } else { 2e-2 };
            assert!(err < tol, "{b}x{h}x{lq}x{lk} {dt:?}: off by {err:.2e}");
            let case = format!("attention {b}x{h}x{lq}x{lk} {dt:?}");
            let us = time_us(&dev, 10, || {
                fused_attention(&q, &k, &v, None, scale).map(|_| ())
            })?;
            report(&format!("{case} fused fwd"), us, None);
            let us = time_us(&dev, 10, || sdpa(&q, &k, &v, None, scale).map(|_| ()))?;
            report(&format!("{case} sdpa fwd"), us, None);
            let (qv, kv, vv) = (
                Var::from_tensor(&q)?,
                Var::from_tensor(&k)?,
                Var::from_tensor(&v)?,
            );
            let us = time_us(&dev, 10, || {
                let o =
                    fused_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), None, scale)?;
                o.sum_all()?.backward().map(|_| ())
            })?;
            report(&format!("{case} fused fwd+bwd"), us, None);
        }
    }
    Ok(())
}
