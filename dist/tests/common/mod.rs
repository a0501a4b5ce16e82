//! What ft-dist's multi-rank tests share: this test executable started as `n` ranks under
//! `mpirun`, each running one ignored test (the rank's body), and each rank's proof that it
//! finished.

use std::path::Path;

/// Runs the ignored test `body` of this executable as `n` ranks under `mpirun`; fails unless
/// the job succeeds and every rank wrote its file ([`finished`]). `Ok(false)` (said on stderr)
/// without an `mpirun`.
pub fn ranks_run(n: usize, body: &str) -> anyhow::Result<bool> {
    let Some(mut cmd) = ft_dist::mpirun(n)? else {
        eprintln!("skipped: no mpirun on PATH");
        return Ok(false);
    };
    let dir = std::env::temp_dir().join(format!("ft-{body}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let out = cmd
        .env("FT_MPI_RANKS_DIR", &dir)
        .arg(std::env::current_exe()?)
        .args([
            "--ignored",
            "--exact",
            body,
            "--test-threads=1",
            "--color=never",
        ])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "mpirun -np {n} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // Every rank ran the whole body (its file written after the last check).
    for r in 0..n {
        assert!(
            dir.join(format!("rank-{r}")).is_file(),
            "rank {r} of {n} did not finish:\n{stdout}\n{stderr}"
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(true)
}

/// Rank `rank`'s file in the folder [`ranks_run`] gave it: written after its body's last check
/// (the ranks' stdout lines interleave).
#[allow(dead_code)] // used by the rank bodies, which each test file has under its own features
pub fn finished(rank: usize) -> anyhow::Result<()> {
    if let Ok(dir) = std::env::var("FT_MPI_RANKS_DIR") {
        std::fs::write(Path::new(&dir).join(format!("rank-{rank}")), b"ok")?;
    }
    Ok(())
}
