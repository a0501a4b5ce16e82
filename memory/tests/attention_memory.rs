//! The models' attention without a graph (the frozen VAE decoding samples) forms its scores a
//! bounded chunk of query rows at a time, measured by the counting allocator. Alone in its test
//! binary so the allocator's counts are this test's only.

use candle_core::{DType, Device, Tensor};
use ft_kernels::attention::{attend, sdpa, MAX_SCORES};
use ft_memory::alloc::{measure_peak, CountingAlloc};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// 8192 tokens in one head (the VAE's shape at 512 px, with narrow channels to keep it quick):
/// the full score matrix is 256 MiB in f32; `attend` stays within a few of its 64 MiB chunks and
/// gives the same output.
#[test]
fn attention_without_a_graph_forms_bounded_scores() -> anyhow::Result<()> {
    let (l, d) = (8192usize, 8usize);
    let x = |seed: f64| -> candle_core::Result<Tensor> {
        Tensor::arange(0u32, (l * d) as u32, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .affine(seed * 1e-4, 0.0)?
            .sin()?
            .reshape((1, 1, l, d))
    };
    let (q, k, v) = (x(1.0)?, x(2.0)?, x(3.0)?);
    let full_scores = l * l * 4;
    let (plain, plain_peak) = measure_peak(|| sdpa(&q, &k, &v, None, 0.35));
    let (chunked, peak) = measure_peak(|| attend(&q, &k, &v, None, 0.35));
    let diff = (plain? - chunked?)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-5, "outputs differ by {diff}");
    eprintln!(
        "peak: full scores {} MiB, sdpa {} MiB, attend {} MiB",
        full_scores >> 20,
        plain_peak >> 20,
        peak >> 20
    );
    assert!(plain_peak >= full_scores);
    assert!(peak <= 3 * MAX_SCORES * 4, "attend peaked at {peak} bytes");
    Ok(())
}
