//! Load once, measured: loading holds no second copy of the weights (the counting allocator's
//! exact heap peak).

use std::sync::Arc;

use candle_core::DType;
use ft_params::weights::SafetensorsFiles;
use ft_trainer::ledger::alloc;

mod common;
use common::{build, shapes_of, tensors, tmpdir, write};

use ft_trainer::ledger::alloc::alone;

#[global_allocator]
static ALLOC: ft_trainer::ledger::alloc::CountingAlloc = ft_trainer::ledger::alloc::CountingAlloc;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Loads `file_dtype` weights as `load_dtype` and returns (peak above start, final bytes, largest).
fn load_peak(file_dtype: DType, load_dtype: DType) -> anyhow::Result<(usize, usize, usize)> {
    let dir = tmpdir(&format!("peak-{file_dtype:?}-{load_dtype:?}"));
    let path = dir.join("model.safetensors");
    let ts = tensors(file_dtype)?;
    write(&path, &ts)?;
    let shapes = shapes_of(&ts);
    drop(ts);
    let elem = load_dtype.size_in_bytes();
    let final_bytes: usize = shapes
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() * elem)
        .sum();
    let largest = shapes
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() * elem)
        .max()
        .unwrap_or(0);
    let files = Arc::new(SafetensorsFiles::open(&[path])?);
    let (store, peak) = alloc::measure_peak(|| build(files.clone(), load_dtype, &shapes));
    let store = store?;
    assert_eq!(store.count(true).1 as usize, final_bytes);
    for (name, t) in store.all() {
        assert_eq!(t.dtype(), load_dtype, "{name}");
        assert!(t.is_variable(), "{name} should be trainable");
    }
    std::fs::remove_dir_all(&dir)?;
    Ok((peak, final_bytes, largest))
}

#[test]
fn loading_never_holds_a_second_copy() -> anyhow::Result<()> {
    alone(&SERIAL, || {
        // Slack for the index, names and Vec headers: far below one tensor.
        let slack = 16 << 10;
        for (file, load) in [
            (DType::F32, DType::F32),
            (DType::BF16, DType::BF16),
            (DType::F32, DType::BF16),
            (DType::BF16, DType::F32),
        ] {
            let (peak, final_bytes, largest) = load_peak(file, load)?;
            assert!(
                peak <= final_bytes + largest + slack,
                "{file:?} -> {load:?}: peak {peak} > final {final_bytes} + largest {largest}"
            );
            assert!(peak >= final_bytes, "the loaded weights must be counted");
        }
        Ok(())
    })
}

#[test]
fn bf16_file_as_bf16_allocates_no_f32_copy() -> anyhow::Result<()> {
    alone(&SERIAL, || {
        let (peak, final_bytes, _) = load_peak(DType::BF16, DType::BF16)?;
        // An f32 staging copy of even the largest tensor alone would add 2x its bf16 bytes; the
        // whole f32 model would double the final size.
        assert!(
            peak < final_bytes + final_bytes / 2,
            "peak {peak}, final {final_bytes}"
        );
        Ok(())
    })
}
