//! Attention memory, measured by the counting allocator: the memory-efficient attention keeps its
//! peak far below the plain one at sequence length 1024 with the same gradients, and the models'
//! attention without a graph (the frozen VAE decoding samples) forms its scores a bounded chunk
//! of query rows at a time. The tests take a lock so that neither measures the other's buffers.

use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, Var};
use ft_kernels::attention::{attend, sdpa, sdpa_memory_efficient, MAX_SCORES};
use ft_trainer::ledger::alloc;

use ft_trainer::ledger::alloc::alone;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn chunked_attention_peak_is_far_below_plain_at_1024_tokens() -> anyhow::Result<()> {
    alone(&ONE_AT_A_TIME, || {
        let (b, h, l, d) = (1, 2, 1024, 32);
        let dev = Device::Cpu;
        let mk = |seed: u64| -> anyhow::Result<Var> {
            let t = ft_kernels::gradcheck::random_tensor(&[b, h, l, d], seed, &dev)?
                .to_dtype(DType::F32)?;
            Ok(Var::from_tensor(&t)?)
        };
        let (q, k, v) = (mk(1)?, mk(2)?, mk(3)?);
        let causal: Vec<f32> = (0..l * l)
            .map(|i| if i % l > i / l { -1e9 } else { 0. })
            .collect();
        let mask = Tensor::from_vec(causal, (1, 1, l, l), &dev)?;
        let scale = 1.0 / (d as f64).sqrt();
        let run = |efficient: bool| -> anyhow::Result<Vec<Tensor>> {
            let y = if efficient {
                sdpa_memory_efficient(
                    q.as_tensor(),
                    k.as_tensor(),
                    v.as_tensor(),
                    Some(&mask),
                    scale,
                    64,
                )?
            } else {
                sdpa(
                    q.as_tensor(),
                    k.as_tensor(),
                    v.as_tensor(),
                    Some(&mask),
                    scale,
                )?
            };
            let g = y.sqr()?.sum_all()?.backward()?;
            Ok([&q, &k, &v]
                .iter()
                .map(|x| g.get(x.as_tensor()).cloned().expect("grad"))
                .collect())
        };
        // One thread: the peak then measures the algorithm, not how many workers hold buffers.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
        let (plain, plain_peak) = pool.install(|| alloc::measure_peak(|| run(false)));
        let (chunked, chunked_peak) = pool.install(|| alloc::measure_peak(|| run(true)));
        let (plain, chunked) = (plain?, chunked?);
        println!("seq 1024 attention forward+backward peak: plain {plain_peak} B, memory-efficient {chunked_peak} B");
        for (a, c) in plain.iter().zip(&chunked) {
            let diff = (a - c)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = a.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                diff <= 1e-4 * scale.max(1e-6),
                "gradients differ by {diff} (scale {scale})"
            );
        }
        // The plain version holds several 1024 x 1024 x 2 heads x 4 B = 8 MiB matrices at once.
        assert!(
            plain_peak > 16 << 20,
            "plain peak {plain_peak} should include the score matrices"
        );
        assert!(
            chunked_peak * 3 < plain_peak,
            "memory-efficient peak {chunked_peak} is not well below plain {plain_peak}"
        );
        Ok(())
    })
}

/// 8192 tokens in one head (the VAE's shape at 512 px, with narrow channels to keep it quick):
/// the full score matrix is 256 MiB in f32; `attend` stays within a few of its 64 MiB chunks and
/// gives the same output.
#[test]
fn attention_without_a_graph_forms_bounded_scores() -> anyhow::Result<()> {
    alone(&ONE_AT_A_TIME, || {
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
        let (plain, plain_peak) = alloc::measure_peak(|| sdpa(&q, &k, &v, None, 0.35));
        let (chunked, peak) = alloc::measure_peak(|| attend(&q, &k, &v, None, 0.35));
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
    })
}
