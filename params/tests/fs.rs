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
