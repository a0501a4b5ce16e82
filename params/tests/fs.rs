//! A failed write never destroys the file that was there.

use ft_params::fs::write_atomic;
use std::io::Write;

#[test]
fn failed_write_keeps_the_old_file_and_leaves_no_temp() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("ftfs-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("checkpoint.bin");
    write_atomic(&path, |f| f.write_all(b"good"))?;
    let r = write_atomic(&path, |f| {
        f.write_all(b"half")?;
        Err(std::io::Error::other("interrupted"))
    });
    assert!(r.unwrap_err().to_string().contains("checkpoint.bin"));
    assert_eq!(std::fs::read(&path)?, b"good");
    assert_eq!(
        std::fs::read_dir(&dir)?.count(),
        1,
        "no temp file left behind"
    );
    write_atomic(&path, |f| f.write_all(b"better"))?;
    assert_eq!(std::fs::read(&path)?, b"better");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Saved weights get the mode every file the run writes gets (the process's umask applied to
/// 0666), where the safetensors writer's private temporary file left them 0600: a container run
/// as root wrote weights the host's user could not read.
#[cfg(unix)]
#[test]
fn saved_weights_have_the_mode_of_the_files_beside_them() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("ftfs-mode-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let t = candle_core::Tensor::ones(3, candle_core::DType::F32, &candle_core::Device::Cpu)?;
    ft_params::fs::save_safetensors(&[("w".into(), t)], &dir.join("model.safetensors"))?;
    write_atomic(&dir.join("config.json"), |f| f.write_all(b"{}"))?;
    let mode = |f: &str| -> anyhow::Result<u32> {
        Ok(std::fs::metadata(dir.join(f))?.permissions().mode() & 0o777)
    };
    assert_eq!(mode("model.safetensors")?, mode("config.json")?);
    assert_ne!(
        mode("model.safetensors")? & 0o044,
        0,
        "others can read it (umask 022)"
    );
    assert_eq!(
        std::fs::read_dir(&dir)?.count(),
        2,
        "no probe or temp file left"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A file written one tensor at a time reads back as the whole-file writer's does (candle's
/// loader, which checks every offset), in any dtype a checkpoint holds; a tensor that comes
/// with another shape than its header's is an error naming it, and the file that was there
/// stays.
#[test]
fn a_streamed_file_reads_back_and_a_wrong_tensor_keeps_the_old_one() -> anyhow::Result<()> {
    use candle_core::{DType, Device, Tensor};
    use ft_params::fs::{save_safetensors_streamed, TensorEntry};
    let dir = std::env::temp_dir().join(format!("ftfs-stream-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let base = Tensor::arange(0f32, 30., &Device::Cpu)?;
    let tensors = vec![
        ("z.last".to_string(), base.reshape((5, 6))?),
        (
            "a.bf16".to_string(),
            base.narrow(0, 0, 7)?.to_dtype(DType::BF16)?,
        ),
        (
            "m.codes".to_string(),
            base.to_dtype(DType::U8)?.reshape((3, 10))?,
        ),
        (
            "h.f16".to_string(),
            (base.narrow(0, 0, 3)? * 0.5)?.to_dtype(DType::F16)?,
        ),
        ("scalar".to_string(), Tensor::new(2.5f64, &Device::Cpu)?),
    ];
    let entries: Vec<TensorEntry> = tensors.iter().map(|(n, t)| TensorEntry::of(n, t)).collect();
    let path = dir.join("optimizer.safetensors");
    save_safetensors_streamed::<ft_params::Error>(&path, &entries, |i| Ok(tensors[i].1.clone()))?;
    let back = candle_core::safetensors::load(&path, &Device::Cpu)?;
    assert_eq!(back.len(), tensors.len());
    for (name, t) in &tensors {
        let b = &back[name];
        assert_eq!((b.dtype(), b.dims()), (t.dtype(), t.dims()), "{name}");
        let (a, b) = (
            t.to_dtype(DType::F64)?.flatten_all()?,
            b.to_dtype(DType::F64)?.flatten_all()?,
        );
        assert_eq!(a.to_vec1::<f64>()?, b.to_vec1::<f64>()?, "{name}");
    }
    let before = std::fs::read(&path)?;
    let wrong = save_safetensors_streamed::<ft_params::Error>(&path, &entries, |i| {
        Ok(if i == 2 {
            tensors[0].1.clone()
        } else {
            tensors[i].1.clone()
        })
    });
    let message = wrong.unwrap_err().to_string();
    assert!(
        message.contains("`m.codes`") && message.contains("optimizer.safetensors"),
        "{message}"
    );
    assert_eq!(std::fs::read(&path)?, before);
    assert_eq!(std::fs::read_dir(&dir)?.count(), 1, "no temp file left");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
