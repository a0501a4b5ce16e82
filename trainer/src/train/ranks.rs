//! This process's place among a data-parallel run's ranks, and what only one of them does.
//!
//! A binary started by `mpirun -np N` (or `srun`) is one of N ranks: each trains on its share of
//! every step's micro-batches and the gradients are summed over the ranks before the update
//! (the loop's part). Rank 0 alone holds the output folder's lock, writes the demo's files,
//! metrics, the memory timeline and the checkpoints, evaluates and prints; the others wait for
//! it where they must. A single process is a world of one, and everything here is then the
//! identity.
//!
//! The communicator lives for the process (MPI is initialised once a process) and is finalised
//! by [`main`], which also ends every rank when one fails: a rank left waiting in a collective
//! its failed partner never joins would hang the job.

use std::cell::RefCell;
use std::fmt::Display;
use std::path::Path;
use std::rc::Rc;

use ft_dist::Comm;

use super::lock::FolderLock;
use crate::error::Result;

thread_local! {
    /// The process's communicator, made at the first [`world`]. Per thread: MPI's handles are
    /// not shared between threads, and only a binary's main thread (or one test's thread) asks.
    static WORLD: RefCell<Option<Rc<Comm>>> = const { RefCell::new(None) };
}

/// The ranks of this run: the launcher's world under `mpirun`/`srun` (with the `mpi` feature),
/// else one process.
pub fn world() -> Result<Rc<Comm>> {
    WORLD.with(|w| {
        if let Some(c) = w.borrow().as_ref() {
            return Ok(c.clone());
        }
        let c = Rc::new(Comm::from_env()?);
        *w.borrow_mut() = Some(c.clone());
        Ok(c)
    })
}

/// Runs a binary's `body` on one of rayon's threads, the CPU's thread counts settled first
/// ([`ft_kernels::threads::run`]: the CPU ops then split without waking the calling thread).
/// One process: returns what it returns. One rank of several: on success the ranks finish
/// together (MPI finalised, on the thread that initialised it); on an error this rank prints
/// it, naming itself, and ends every rank with exit status 1.
pub fn main<E: Display + Send>(
    body: impl FnOnce() -> std::result::Result<(), E> + Send,
) -> std::result::Result<(), E> {
    ft_kernels::threads::run(|| finish(body()))
}

/// The end of [`main`]'s work, on the thread that ran it (the communicator is that thread's).
fn finish<E: Display>(result: std::result::Result<(), E>) -> std::result::Result<(), E> {
    let Some(comm) = WORLD.with(|w| w.borrow_mut().take()) else {
        return result;
    };
    match result {
        Err(e) if comm.world() > 1 => {
            // One write of the whole line: `eprintln!` writes its pieces one by one, and
            // mpirun's abort notice, on the same pipe, came between them.
            let line = format!("Error (rank {} of {}): {e}\n", comm.rank(), comm.world());
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            comm.abort(1)
        }
        other => {
            // The last rank's drop finalises MPI.
            drop(comm);
            other
        }
    }
}

/// Whether this process is rank 0 (the one that writes and prints); true for one process.
pub fn is_main() -> Result<bool> {
    Ok(world()?.is_main())
}

/// Rank 0 runs `write` (the demo's files, a checkpoint) while the others wait for it; every
/// rank returns once it is done. An error on rank 0 is returned there ([`main`] then ends the
/// others).
pub fn main_first<T, E: From<crate::error::Error>>(
    write: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<Option<T>, E> {
    let w = world()?;
    let out = if w.is_main() { Some(write()?) } else { None };
    w.barrier();
    Ok(out)
}

/// The output folder's lock for this run: taken by rank 0, for every rank (the others write
/// nothing there). See [`FolderLock`].
pub fn lock_output(dir: &Path) -> Result<Option<FolderLock>> {
    if is_main()? {
        Ok(Some(FolderLock::acquire(dir)?))
    } else {
        Ok(None)
    }
}

/// Prints `text` to stderr on rank 0 only.
pub fn say(text: impl Display) {
    if is_main().unwrap_or(true) {
        eprint!("{text}");
    }
}

/// Runs `program` (one of the binaries) with `args`, `--output-dir out` and `--quiet` as `np`
/// ranks (by itself for one, under `mpirun` for more) and returns the step losses rank 0 logged
/// in `out/metrics.jsonl`: how a data-parallel run is set beside one process (the binaries'
/// `tests/ranks.rs`). `None` when more ranks are asked for and there is no `mpirun` (see
/// [`ft_dist::mpirun`]); a run that fails is an error carrying its stderr.
/// Under `mpirun` the job has [`ft_dist::mpirun`]'s time limit.
pub fn train_as_ranks(
    np: usize,
    program: &str,
    args: &[&str],
    out: &Path,
) -> Result<Option<Vec<f64>>> {
    let Some(mut cmd) = ft_dist::ranks_of(np, program)? else {
        eprintln!("skipped: no mpirun on PATH");
        return Ok(None);
    };
    let r = cmd
        .args(args)
        .arg("--output-dir")
        .arg(out)
        .arg("--quiet")
        .output()
        .map_err(|e| crate::error::Error::io(Path::new(program), e))?;
    if !r.status.success() {
        return Err(crate::error::Error::Invalid(format!(
            "{program} as {np} ranks, {args:?}: {}\n{}",
            r.status,
            String::from_utf8_lossy(&r.stderr)
        )));
    }
    let losses = super::metrics::logged(&out.join("metrics.jsonl"), "loss")?;
    Ok(Some(losses.iter().filter_map(|v| v.as_f64()).collect()))
}
