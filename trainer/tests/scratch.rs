//! A scratch path is absent when made and gone once its guard drops: a folder with contents, a
//! file, and a folder whose test panicked.

use ft_trainer::scratch::Scratch;

#[test]
fn a_folder_with_contents_goes_when_the_guard_drops() -> anyhow::Result<()> {
    let s = Scratch::new("ft-scratch-folder");
    assert!(!s.exists(), "made absent");
    std::fs::create_dir_all(s.join("a/b"))?;
    std::fs::write(s.join("a/b/c.bin"), [0u8; 64])?;
    let path = s.path_buf();
    drop(s);
    assert!(!path.exists(), "{} left behind", path.display());
    Ok(())
}

#[test]
fn a_file_goes_and_a_leftover_is_cleared() -> anyhow::Result<()> {
    let s = Scratch::new("ft-scratch-file");
    std::fs::write(&*s, "x = 1\n")?;
    let path = s.path_buf();
    // What an earlier process of this id left at the path: the next guard starts without it.
    std::mem::forget(s);
    assert!(path.is_file());
    let again = Scratch::new("ft-scratch-file");
    assert!(!again.exists(), "a leftover file is removed when made");
    std::fs::write(&*again, "y = 2\n")?;
    drop(again);
    assert!(!path.exists(), "{} left behind", path.display());
    Ok(())
}

#[test]
fn a_panicking_test_leaves_nothing() {
    let path = std::env::temp_dir().join(format!("ft-scratch-panic-{}", std::process::id()));
    let result = std::panic::catch_unwind(|| {
        let s = Scratch::new("ft-scratch-panic");
        std::fs::create_dir_all(s.join("out")).expect("create");
        assert!(s.join("out").is_dir());
        panic!("a failing assertion");
    });
    assert!(result.is_err());
    assert!(!path.exists(), "{} left behind", path.display());
}
