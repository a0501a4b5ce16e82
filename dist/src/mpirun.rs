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
pub fn mpirun(np: usize) -> Result<Option<RanksCommand>> {
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
    let mut session = None;
    if version.contains("Open MPI") {
        cmd.arg("--oversubscribe")
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        if !TMPDIR_PARAMS.iter().any(|v| std::env::var_os(v).is_some()) {
            // Jobs started at the same moment (tests in parallel) each make the per-host
            // session directory `ompi.HOST.UID` under the temp folder, and Open MPI 4 fails
            // the one whose `mkdir` finds it made ("File exists", orte_init failed): each job
            // gets a base folder of its own (unless the user chose one).
            let dir = SessionDir::new()?;
            cmd.env(TMPDIR_PARAMS[0], &dir.0)
                .env(TMPDIR_PARAMS[3], &dir.0);
            session = Some(dir);
        }
    }
    if std::env::var_os("MPIEXEC_TIMEOUT").is_none() {
        cmd.env("MPIEXEC_TIMEOUT", TIMEOUT_S.to_string());
    }
    cmd.args(["-np", &np.to_string()]);
    Ok(Some(RanksCommand {
        command: cmd,
        _session: session,
    }))
}

/// Open MPI 4's (ORTE) and 5's (PRRTE) parameters for where session directories go: the first
/// and fourth are set for a job; any of them set by the user leaves the choice to them (ORTE
/// and PRRTE refuse the global one beside a local or remote one).
const TMPDIR_PARAMS: [&str; 6] = [
    "OMPI_MCA_orte_tmpdir_base",
    "OMPI_MCA_orte_local_tmpdir_base",
    "OMPI_MCA_orte_remote_tmpdir_base",
    "PRTE_MCA_prte_tmpdir_base",
    "PRTE_MCA_prte_local_tmpdir_base",
    "PRTE_MCA_prte_remote_tmpdir_base",
];

/// A command that starts ranks (use it as the [`Command`] it derefs to), with the folder its
/// Open MPI session directories go in, removed when this is dropped (after the job).
pub struct RanksCommand {
    command: Command,
    _session: Option<SessionDir>,
}

impl std::ops::Deref for RanksCommand {
    type Target = Command;
    fn deref(&self) -> &Command {
        &self.command
    }
}

impl std::ops::DerefMut for RanksCommand {
    fn deref_mut(&mut self) -> &mut Command {
        &mut self.command
    }
}

/// One job's base folder for Open MPI's session directories: made fresh (never one that
/// exists, mode 0700) under the temp folder, removed on drop.
struct SessionDir(std::path::PathBuf);

impl SessionDir {
    fn new() -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("ft-ompi-{}-{n}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(SessionDir(dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 10_000 => {}
                Err(e) => {
                    return Err(DistError::Launch(format!(
                        "cannot make {} for mpirun: {e}",
                        dir.display()
                    )))
                }
            }
        }
    }
}

impl Drop for SessionDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `program` started as `np` ranks: by itself for one, under [`mpirun`] for more (`None`
/// without an `mpirun`, as there).
pub fn ranks_of(np: usize, program: impl AsRef<std::ffi::OsStr>) -> Result<Option<RanksCommand>> {
    if np == 1 {
        return Ok(Some(RanksCommand {
            command: Command::new(program),
            _session: None,
        }));
    }
    Ok(mpirun(np)?.map(|mut c| {
        c.arg(program);
        c
    }))
}
