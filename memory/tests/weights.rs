//! Load once: dtype conversion on read, no second copy, sharded files, clear errors.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use ft_memory::alloc;
use ft_memory::weights::{Init, ModelRepo, ParamBuilder, ParamStore, SafetensorsFiles};

#[global_allocator]
static ALLOC: ft_memory::alloc::CountingAlloc = ft_memory::alloc::CountingAlloc;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ftw-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// A little model: a few tensors of different sizes, values that are not round in bf16.
fn tensors(dtype: DType) -> anyhow::Result<Vec<(String, Tensor)>> {
    let dev = Device::Cpu;
    let shapes: [(&str, &[usize]); 4] = [
        ("embed.weight", &[300, 64]),
        ("block.0.attn.q.weight", &[64, 64]),
        ("block.0.norm.weight", &[64]),
        ("head.weight", &[500, 64]),
    ];
    let mut out = Vec::new();
    for (i, (name, shape)) in shapes.iter().enumerate() {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|j| ((j * 7 + i * 13) % 97) as f32 / 97.0 - 0.5 + 1e-4)
            .collect();
        out.push((
            name.to_string(),
            Tensor::from_vec(v, *shape, &dev)?.to_dtype(dtype)?,
        ));
    }
    Ok(out)
}

fn write(path: &Path, ts: &[(String, Tensor)]) -> anyhow::Result<()> {
    ft_memory::fsutil::save_safetensors(ts, path)?;
    Ok(())
}

fn build(
    files: Arc<SafetensorsFiles>,
    dtype: DType,
    shapes: &[(String, Vec<usize>)],
) -> anyhow::Result<Arc<ParamStore>> {
    let store = ParamStore::new();
    let pb = ParamBuilder::new(store.clone(), dtype, &Device::Cpu, 0).with_source(files);
    for (name, shape) in shapes {
        pb.get(shape, name, Init::Zeros)?;
    }
    Ok(store)
}

fn shapes_of(ts: &[(String, Tensor)]) -> Vec<(String, Vec<usize>)> {
    ts.iter()
        .map(|(n, t)| (n.clone(), t.dims().to_vec()))
        .collect()
}

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
    let _g = SERIAL.lock();
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
}

#[test]
fn bf16_file_as_bf16_allocates_no_f32_copy() -> anyhow::Result<()> {
    let _g = SERIAL.lock();
    let (peak, final_bytes, _) = load_peak(DType::BF16, DType::BF16)?;
    // An f32 staging copy of even the largest tensor alone would add 2x its bf16 bytes; the
    // whole f32 model would double the final size.
    assert!(
        peak < final_bytes + final_bytes / 2,
        "peak {peak}, final {final_bytes}"
    );
    Ok(())
}

#[test]
fn values_convert_exactly_between_dtypes() -> anyhow::Result<()> {
    let _g = SERIAL.lock();
    let dir = tmpdir("convert");
    let path = dir.join("model.safetensors");
    let ts = tensors(DType::F32)?;
    write(&path, &ts)?;
    let files = SafetensorsFiles::open(&[path])?;
    for (name, t) in &ts {
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let got = files.load(name, Some(t.dims()), dt, &Device::Cpu, false)?;
            let want = t.to_dtype(dt)?;
            let diff = (got.to_dtype(DType::F64)? - want.to_dtype(DType::F64)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f64>()?;
            assert_eq!(diff, 0.0, "{name} as {dt:?}");
        }
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn sharded_checkpoint_loads_through_its_index() -> anyhow::Result<()> {
    let _g = SERIAL.lock();
    let dir = tmpdir("sharded");
    let ts = tensors(DType::F32)?;
    let (a, b) = ts.split_at(2);
    write(&dir.join("model-00001-of-00002.safetensors"), a)?;
    write(&dir.join("model-00002-of-00002.safetensors"), b)?;
    let mut map = serde_json::Map::new();
    for (i, (n, _)) in ts.iter().enumerate() {
        let f = if i < 2 {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        map.insert(n.clone(), serde_json::Value::from(f));
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string())?;
    // The same shards in a diffusers subfolder (`unet/`): shard names are relative to it.
    let sub = dir.join("unet");
    std::fs::create_dir_all(&sub)?;
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ] {
        std::fs::copy(dir.join(f), sub.join(f))?;
    }
    let repo = ModelRepo::open(dir.to_str().unwrap_or_default())?;
    for stem in ["model", "unet/model"] {
        let files = Arc::new(repo.safetensors(stem)?);
        assert_eq!(files.paths().len(), 2);
        let store = build(files, DType::F32, &shapes_of(&ts))?;
        for (name, t) in &ts {
            let got = store.get(name).expect("loaded");
            let d = (got - t)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "{stem}: {name}");
        }
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn missing_tensor_wrong_shape_and_corrupt_header_name_file_and_tensor() -> anyhow::Result<()> {
    let _g = SERIAL.lock();
    let dir = tmpdir("errors");
    let path = dir.join("model.safetensors");
    write(&path, &tensors(DType::F32)?)?;
    let files = Arc::new(SafetensorsFiles::open(std::slice::from_ref(&path))?);
    let file = path.display().to_string();

    let pb = ParamBuilder::new(ParamStore::new(), DType::F32, &Device::Cpu, 0).with_source(files);
    let e = pb
        .get(&[64], "block.1.norm.weight", Init::Ones)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("block.1.norm.weight") && e.contains(&file),
        "{e}"
    );

    let e = pb
        .pp("block.0")
        .get(&[32, 64], "attn.q.weight", Init::Zeros)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("block.0.attn.q.weight") && e.contains(&file),
        "{e}"
    );
    assert!(e.contains("[64, 64]") && e.contains("[32, 64]"), "{e}");

    let bad = dir.join("corrupt.safetensors");
    let mut bytes = std::fs::read(&path)?;
    bytes[8] = b'!'; // the JSON header now starts with garbage
    std::fs::write(&bad, &bytes)?;
    let e = SafetensorsFiles::open(std::slice::from_ref(&bad))
        .err()
        .expect("corrupt")
        .to_string();
    assert!(e.contains("corrupt.safetensors"), "{e}");

    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2])?;
    let e = SafetensorsFiles::open(std::slice::from_ref(&truncated))
        .err()
        .expect("truncated")
        .to_string();
    assert!(e.contains("truncated.safetensors"), "{e}");

    let e = SafetensorsFiles::open(&[dir.join("absent.safetensors")])
        .err()
        .expect("absent")
        .to_string();
    assert!(e.contains("absent.safetensors"), "{e}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn initialised_parameters_are_seeded_and_tied_names_share_one_tensor() -> anyhow::Result<()> {
    let _g = SERIAL.lock();
    let mk = |seed| -> anyhow::Result<(Arc<ParamStore>, Tensor, Tensor)> {
        let store = ParamStore::new();
        let pb = ParamBuilder::new(store.clone(), DType::F32, &Device::Cpu, seed);
        let a = pb
            .pp("shared")
            .get(&[8, 4], "weight", Init::Normal { std: 0.02 })?;
        let b = pb
            .pp("shared")
            .get(&[8, 4], "weight", Init::Normal { std: 0.02 })?;
        Ok((store, a, b))
    };
    let (store, a, b) = mk(1)?;
    assert_eq!(store.all().len(), 1, "a tied weight is one parameter");
    assert_eq!(a.id(), b.id());
    let (_, a2, _) = mk(1)?;
    let (_, a3, _) = mk(2)?;
    assert_eq!((&a - &a2)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
    assert!((&a - &a3)?.abs()?.max_all()?.to_scalar::<f32>()? > 0.0);
    let std = a.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>()?;
    assert!((0.01..0.03).contains(&std), "std {std}");
    Ok(())
}

/// Large tensors are initialised in parallel chunks: still a function of the seed, with the
/// requested statistics, and no chunk repeating another.
#[test]
fn large_initialisation_is_seeded_with_independent_chunks() -> anyhow::Result<()> {
    let _g = SERIAL.lock();
    let mk = |seed| -> anyhow::Result<Vec<f32>> {
        let pb = ParamBuilder::new(ParamStore::new(), DType::F32, &Device::Cpu, seed);
        Ok(pb
            .get(&[1 << 21], "big", Init::Normal { std: 0.5 })?
            .to_vec1::<f32>()?)
    };
    let a = mk(3)?;
    assert_eq!(a, mk(3)?);
    assert_ne!(a, mk(4)?);
    let n = a.len() as f64;
    let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
    let std = (a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    assert!(
        mean.abs() < 2e-3 && (std - 0.5).abs() < 2e-3,
        "mean {mean} std {std}"
    );
    // Chunks of 65,536 come from distinct streams.
    assert_ne!(a[..1 << 16], a[1 << 16..2 << 16]);
    Ok(())
}
