//! The fused attention kernels (CUDA cores and tensor cores) against `sdpa`.

use candle_core::{DType, Device, Result, Tensor, Var};
use ft_kernels::attention;
use ft_kernels::gradcheck::random_tensor;

use super::common::{compare, gpu, rel};

/// The fused attention kernels (64-dim heads) against `sdpa` on the CPU: `attend` picks the
/// kernels on CUDA and `sdpa` on the CPU. Lengths are not multiples of the 64-row tiles; the
/// bias cases check its gradient (a [1, H, Lq, Lk] position bias broadcast over the batch, a
/// [B, 1, 1, Lk] padding mask with large negatives).
#[test]
fn fused_attention_matches_sdpa() -> Result<()> {
    let Some(dev) = gpu() else { return Ok(()) };
    let r = |shape: &[usize], seed: u64| random_tensor(shape, seed, &Device::Cpu);
    compare(
        "fused attention, self",
        &dev,
        &[
            r(&[2, 3, 130, 64], 30)?,
            r(&[2, 3, 130, 64], 31)?,
            r(&[2, 3, 130, 64], 32)?,
        ],
        |t| attention::attend(&t[0], &t[1], &t[2], None, 0.125),
    )?;
    compare(
        "fused attention, cross with position bias",
        &dev,
        &[
            r(&[2, 4, 70, 64], 33)?,
            r(&[2, 4, 77, 64], 34)?,
            r(&[2, 4, 77, 64], 35)?,
            r(&[1, 4, 70, 77], 36)?,
        ],
        |t| attention::attend(&t[0], &t[1], &t[2], Some(&t[3]), 1.0),
    )?;
    // Padding mask: the last 9 keys of the second sequence are masked out.
    let mask: Vec<f32> = (0..2 * 40)
        .map(|i| if i >= 40 + 31 { -1e9 } else { 0.0 })
        .collect();
    let mask = Tensor::from_vec(mask, (2, 1, 1, 40), &Device::Cpu)?;
    compare(
        "fused attention, padding mask",
        &dev,
        &[
            r(&[2, 2, 40, 64], 37)?,
            r(&[2, 2, 40, 64], 38)?,
            r(&[2, 2, 40, 64], 39)?,
        ],
        |t| {
            let m = mask.to_device(t[0].device())?.to_dtype(t[0].dtype())?;
            attention::attend(&t[0], &t[1], &t[2], Some(&m), 0.125)
        },
    )?;
    // bf16 gradients (the tensor-core backward on sm_80+) against the f32 CPU gradients.
    let inputs = [
        r(&[2, 3, 100, 64], 43)?,
        r(&[2, 3, 90, 64], 44)?,
        r(&[2, 3, 90, 64], 45)?,
        r(&[1, 3, 100, 90], 46)?,
    ];
    let grads_on = |d: &Device, dt: DType| -> Result<Vec<Tensor>> {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.to_dtype(dt)?.to_device(d)?))
            .collect::<Result<_>>()?;
        let t: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = attention::attend(&t[0], &t[1], &t[2], Some(&t[3]), 0.125)?;
        let w = random_tensor(y.dims(), 47, &Device::Cpu)?
            .to_dtype(dt)?
            .to_device(d)?;
        let g = (y * w)?.sum_all()?.backward()?;
        vars.iter()
            .map(|v| {
                g.get(v.as_tensor())
                    .cloned()
                    .ok_or_else(|| candle_core::Error::Msg("missing gradient".into()))
            })
            .collect()
    };
    let cpu = grads_on(&Device::Cpu, DType::F32)?;
    let gpu = grads_on(&dev, DType::BF16)?;
    for (i, (a, b)) in gpu.iter().zip(&cpu).enumerate() {
        let e = rel(a, b)?;
        assert!(
            e < 3e-2,
            "bf16 attention gradient of input {i} differs by {e:.2e}"
        );
    }
    // The memory-efficient entry point takes the same kernels on CUDA.
    let q = r(&[1, 2, 65, 64], 40)?.to_dtype(DType::F32)?;
    let k = r(&[1, 2, 33, 64], 41)?.to_dtype(DType::F32)?;
    let v = r(&[1, 2, 33, 64], 42)?.to_dtype(DType::F32)?;
    let cpu = attention::sdpa(&q, &k, &v, None, 0.125)?;
    let gpu = attention::sdpa_memory_efficient(
        &q.to_device(&dev)?,
        &k.to_device(&dev)?,
        &v.to_device(&dev)?,
        None,
        0.125,
        64,
    )?;
    let e = rel(&gpu, &cpu)?;
    assert!(e < 1e-4, "sdpa_memory_efficient on CUDA differs by {e:.2e}");
    Ok(())
}
