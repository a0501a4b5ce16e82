//! The system's `mpirun`, as tests and scripts start ranks on one machine with it.

use std::process::Command;

use crate::error::{DistError, Result};

/// How long a job that [`mpirun`] starts may run unless `MPIEXEC_TIMEOUT` says otherwise: the
/// tests' jobs take seconds to a minute on two cores; ten minutes is a hang (a rank waiting in
/// a collective that another never joins), which then fails instead of holding CI.
pub const TIMEOUT_S: u64 = 600;

/// `mpirun -np {np}` (add the program and its arguments), with what Open MPI needs to start
/// more ranks than the machine has cores and to run as root in a container, and a time limit
/// ([`TIMEOUT_S`], as `MPIEXEC_TIMEOUT`, which Open MPI's and MPICH's launchers both read; a
/// value already in the environment is kept). `None` when no `mpirun` is on PATH, unless
/// `FT_REQUIRE_MPI=1` (CI) makes that an error.
pub fn mpirun(np: usize) -> Result<Option<Command>> {
    let version = match Command::new("mpirun").arg("--version").output() {
        Ok(o) => String::from_utf8_lossy(&o.stdout).to_string(),
        Err(e) => {
            if std::env::var("FT_REQUIRE_MPI").is_ok_and(|v| v == "1") {
                return Err(DistError::Launch(format!(
                    "FT_REQUIRE_MPI=1 and no mpirun on PATH: {e}"
                )));
            }
            return Ok(None);
        }
    };
    let mut cmd = Command::new("mpirun");
    if version.contains("Open MPI") {
        cmd.arg("--oversubscribe")
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        if std::env::var_os("OMPI_MCA_orte_tmpdir_base").is_none() {
            // Jobs started at the same moment (tests in parallel) each make the per-host
            // session directory `ompi.HOST.UID` under the temp folder, and Open MPI 4 fails
            // the one whose `mkdir` finds it made ("File exists", orte_init failed): each job
            // gets a base folder of its own.
            let base = session_base()?;
            cmd.env("OMPI_MCA_orte_tmpdir_base", &base)
                .env("PRTE_MCA_prte_tmpdir_base", &base);
        }
    }
    if std::env::var_os("MPIEXEC_TIMEOUT").is_none() {
        cmd.env("MPIEXEC_TIMEOUT", TIMEOUT_S.to_string());
    }
    cmd.args(["-np", &np.to_string()]);
    Ok(Some(cmd))
}

/// A fresh folder for one job's Open MPI session directories: under the temp folder, named by
/// this process and a count.
fn session_base() -> Result<std::path::PathBuf> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ft-ompi-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| DistError::Launch(format!("cannot make {} for mpirun: {e}", dir.display())))?;
    Ok(dir)
}

/// `program` started as `np` ranks: by itself for one, under [`mpirun`] for more (`None`
/// without an `mpirun`, as there).
pub fn ranks_of(np: usize, program: impl AsRef<std::ffi::OsStr>) -> Result<Option<Command>> {
    if np == 1 {
        return Ok(Some(Command::new(program)));
    }
    Ok(mpirun(np)?.map(|mut c| {
        c.arg(program);
        c
    }))
}
