//! gemm's per-thread slabs are made by the ledger's warm-up, under whichever kernels gemm picks
//! on this CPU (AVX2, or AVX-512 with the workspace's `x86-v4` feature), so the products a
//! model runs afterwards keep nothing: no slab appears in the phase that multiplies first.
//! One test in its own binary: the counting allocator's bytes are the process's.

use candle_core::{Device, Tensor};
use ft_trainer::ledger::alloc;

#[global_allocator]
static ALLOC: alloc::CountingAlloc = alloc::CountingAlloc;

#[test]
fn products_after_the_warm_up_keep_no_bytes() -> candle_core::Result<()> {
    // A thread of its own: the test harness's threads may have multiplied before.
    std::thread::spawn(|| -> candle_core::Result<()> {
        let d = Device::Cpu;
        // (m, k, n), row-major and with a transposed right operand: the shapes of a tiny T5's
        // projections and of small convolutions' column products.
        let shapes = [
            (16, 64, 64),
            (64, 64, 256),
            (128, 64, 256),
            (256, 256, 256),
            (96, 32, 512),
        ];
        let mut operands = Vec::new();
        for (m, k, n) in shapes {
            let a = Tensor::ones((m, k), candle_core::DType::F32, &d)?;
            let b = Tensor::ones((k, n), candle_core::DType::F32, &d)?;
            let bt = Tensor::ones((n, k), candle_core::DType::F32, &d)?.t()?;
            operands.push((a, b, bt));
        }
        ft_trainer::ledger::measure::warm_matmul_scratch();
        let before = alloc::live_bytes();
        for (a, b, bt) in &operands {
            drop(a.matmul(b)?);
            drop(a.matmul(bt)?);
        }
        let after = alloc::live_bytes();
        assert_eq!(
            after,
            before,
            "the products kept {} bytes after the warm-up",
            after as i64 - before as i64
        );
        Ok(())
    })
    .join()
    .map_err(|_| candle_core::Error::Msg("the measuring thread panicked".into()))?
}
