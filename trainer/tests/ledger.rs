//! The ledger's told bytes, deltas, timeline and leak suspicion.

use candle_core::{DType, Device, Tensor};
use ft_params::bytes::format_bytes;
use ft_trainer::ledger::alloc::alone;
use ft_trainer::ledger::{Category, Ledger};

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

/// Tests that read the process-wide counters run one at a time, and so do the others that
/// allocate (a tensor freed on another thread between two marks lowers the delta read).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn told_bytes_are_exact_per_category() -> anyhow::Result<()> {
    alone(&SERIAL, || {
        let dev = Device::Cpu;
        let mut l = Ledger::new(&dev);
        let w = Tensor::zeros((3, 5), DType::BF16, &dev)?;
        let b = Tensor::zeros(7, DType::F32, &dev)?;
        l.set_tensors(Category::Parameters, "unet", [&w, &b]);
        l.set(Category::OptimizerState, "unet", 1000);
        assert_eq!(l.told(Category::Parameters), 3 * 5 * 2 + 7 * 4);
        assert_eq!(l.told(Category::OptimizerState), 1000);
        l.remove(Category::OptimizerState, "unet");
        assert_eq!(l.told(Category::OptimizerState), 0);
        assert!(!l.told_by_category().contains_key(&Category::OptimizerState));
        Ok(())
    })
}

#[test]
fn marks_measure_live_bytes_and_deltas() -> anyhow::Result<()> {
    alone(&SERIAL, || {
        let dev = Device::Cpu;
        let mut l = Ledger::new(&dev);
        assert!(l.is_measured());
        l.set_baseline();
        let big = vec![1u8; 4 << 20];
        let p = l.mark("forward", 0)?.clone();
        // Other test threads allocate too; the 4 MiB buffer must be visible in any case.
        assert!(
            p.delta >= (3 << 20),
            "delta {} should include 4 MiB",
            p.delta
        );
        assert!(p.peak >= p.live);
        drop(big);
        Ok(())
    })
}

/// The measured peak set beside the plan counts the run's own bytes: the training phases' peak
/// above the baseline (not an evaluation's), less what was held when training started and not
/// told (the data, also what was loaded after the run's first point, as sdxl-ft's cached
/// latents are).
#[test]
fn the_peak_against_the_plan_leaves_out_the_data() -> anyhow::Result<()> {
    alone(&SERIAL, || {
        let dev = Device::Cpu;
        let mut l = Ledger::new(&dev);
        l.set_baseline();
        let mib = 1usize << 20;
        let data = vec![1u8; 8 * mib];
        l.mark("cache", 0)?;
        let more_data = vec![1u8; 8 * mib];
        let weights = Tensor::zeros(mib, DType::F32, &dev)?; // 4 MiB, told
        l.set_tensors(Category::Parameters, "model", [&weights]);
        l.mark("load", 0)?;
        l.set_predicted_peak(40 * mib as u64);
        assert_eq!(l.peak_against_plan(), None, "training has not started");
        l.training_starts();
        let transient = std::hint::black_box(vec![2u8; 32 * mib]);
        drop(transient);
        l.mark("step", 1)?;
        // An evaluation's peak is not the plan's to predict.
        let eval = std::hint::black_box(vec![3u8; 64 * mib]);
        drop(eval);
        l.mark("eval/after", 1)?;
        let (predicted, measured) = l.peak_against_plan().expect("measured on the CPU");
        assert_eq!(predicted, 40 * mib as u64);
        // 4 MiB of weights and 32 of the step; the 16 MiB of data are left out (other test
        // threads allocate a little too).
        let m = measured as f64 / mib as f64;
        assert!((35.5..40.0).contains(&m), "{m} MiB");
        assert!(
            l.table().contains("the plan predicted 40.00 MiB"),
            "{}",
            l.table()
        );
        drop((data, more_data));
        Ok(())
    })
}

#[test]
fn growing_phase_is_a_leak_suspect_and_stable_is_not() -> anyhow::Result<()> {
    alone(&SERIAL, || {
        let dev = Device::Cpu;
        let dir = std::env::temp_dir().join(format!("ledger-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let timeline = dir.join("memory.jsonl");

        // A run whose evaluation frees what it allocates: nothing to report.
        let mut stable = Ledger::new(&dev);
        stable.set_baseline();
        for step in 0..4 {
            let samples = vec![0u8; 8 << 20];
            stable.mark("eval/ema", step)?;
            drop(samples);
            stable.mark("eval/after", step)?;
        }
        assert!(stable.leak_suspects(3, 1 << 20).is_empty());

        // A run that keeps 8 MiB of samples after each evaluation (seed 003's pattern).
        let mut leaky = Ledger::new(&dev).with_timeline(&timeline)?;
        leaky.set_baseline();
        let mut kept: Vec<Vec<u8>> = Vec::new();
        for step in 0..4 {
            kept.push(vec![1u8; 8 << 20]);
            leaky.mark("eval/after", step)?;
        }
        let suspects = leaky.leak_suspects(3, 1 << 20);
        assert_eq!(suspects.len(), 1, "{suspects:?}");
        assert_eq!(suspects[0].phase, "eval/after");
        assert!(suspects[0].last_delta - suspects[0].first_delta >= 15 << 20);
        let table = leaky.table();
        assert!(table.contains("possible leak: `eval/after`"), "{table}");
        let lines = std::fs::read_to_string(&timeline)?;
        assert_eq!(lines.lines().count(), 4);
        let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap_or(""))?;
        assert_eq!(first["phase"], "eval/after");
        assert!(first["live_bytes"].as_u64().is_some());
        std::fs::remove_dir_all(&dir)?;
        drop(kept);
        Ok(())
    })
}

#[test]
fn bytes_format_readably() {
    assert_eq!(format_bytes(512), "512 B");
    assert_eq!(format_bytes(3 << 20), "3.00 MiB");
    assert_eq!(format_bytes(-(5 << 30)), "-5.00 GiB");
}

/// `alone` returns after its thread's thread-locals are freed (a slab made the way gemm makes its
/// own is off the live count when it returns, not later inside another test's window).
#[test]
fn alone_returns_after_its_threads_locals_are_freed() {
    use ft_trainer::ledger::alloc::live_bytes;
    thread_local! {
        static SLAB: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    static INNER: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = SERIAL.lock();
    let before = live_bytes();
    let held = alone(&INNER, || {
        SLAB.with(|s| *s.borrow_mut() = vec![1u8; 8 << 20]);
        live_bytes()
    });
    let after = live_bytes();
    assert!(held >= before + (8 << 20), "{before} -> {held}");
    assert!(
        after < before + (1 << 20),
        "{before} -> {after}: the slab outlived alone"
    );
}
