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
