//! Load once: dtype conversion on read, sharded files, clear errors, seeded initialisation.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use ft_params::weights::SafetensorsFiles;
use ft_params::{Init, ParamBuilder, ParamStore};

mod common;
use common::{tensors, tmpdir, write};

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

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
