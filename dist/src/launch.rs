//! Where this process stands in a launch: rank, world size and local rank, from the launcher's
//! environment.

use crate::error::{DistError, Result};

/// This process's place in the launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// 0 to `world - 1`; rank 0 logs, evaluates and saves.
    pub rank: usize,
    pub world: usize,
    /// The rank among the processes on this host: the GPU a rank takes.
    pub local_rank: usize,
    /// Who launched it: `mpirun (Open MPI)`, `mpiexec (MPICH)`, `srun`, `torchrun`, or `none`.
    pub launcher: &'static str,
}

/// The variables each launcher sets: (launcher, rank, world size, local rank), in the order
/// they are looked for. An `mpirun` inside a Slurm allocation sets its own besides Slurm's, so
/// the MPI launchers come first.
const LAUNCHERS: [(&str, &str, &str, &str); 4] = [
    (
        "mpirun (Open MPI)",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ),
    ("mpiexec (MPICH)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
];

impl Launch {
    /// One process, launched by nobody.
    pub fn single() -> Self {
        Launch {
            rank: 0,
            world: 1,
            local_rank: 0,
            launcher: "none",
        }
    }

    /// This process's launch, from its environment.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// The launch that the variables `var` gives name (the first launcher whose rank variable
    /// is set; a single process when none is).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        for (launcher, rank_var, world_var, local_var) in LAUNCHERS {
            let Some(rank) = var(rank_var) else { continue };
            let number = |name: &str, value: Option<String>| -> Result<usize> {
                let value = value.ok_or_else(|| {
                    DistError::Launch(format!("{rank_var} is set ({launcher}) but {name} is not"))
                })?;
                value.trim().parse().map_err(|_| {
                    DistError::Launch(format!("{name}=`{value}` is not a count ({launcher})"))
                })
            };
            let rank = number(rank_var, Some(rank))?;
            let world = number(world_var, var(world_var))?;
            // A launcher that gives no local rank: one process a host.
            let local_rank = match var(local_var) {
                Some(v) => number(local_var, Some(v))?,
                None => 0,
            };
            if world == 0 || rank >= world {
                return Err(DistError::Launch(format!(
                    "{rank_var}={rank} with {world_var}={world} ({launcher}): the rank must be \
                     under the world size"
                )));
            }
            return Ok(Launch {
                rank,
                world,
                local_rank,
                launcher,
            });
        }
        Ok(Self::single())
    }

    /// Whether this process is one of several.
    pub fn is_distributed(&self) -> bool {
        self.world > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(vars: &[(&str, &str)]) -> Result<Launch> {
        Launch::from_vars(|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn each_launcher_is_read() -> Result<()> {
        assert_eq!(launch(&[])?, Launch::single());
        let ompi = launch(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "5"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ])?;
        assert_eq!((ompi.rank, ompi.world, ompi.local_rank), (3, 5, 1));
        assert_eq!(ompi.launcher, "mpirun (Open MPI)");
        assert!(ompi.is_distributed());
        let mpich = launch(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")])?;
        assert_eq!((mpich.rank, mpich.world, mpich.local_rank), (1, 2, 0));
        let slurm = launch(&[
            ("SLURM_PROCID", "7"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "3"),
        ])?;
        assert_eq!(
            (slurm.rank, slurm.local_rank, slurm.launcher),
            (7, 3, "srun")
        );
        // mpirun inside a Slurm allocation: mpirun's numbers.
        let both = launch(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ])?;
        assert_eq!((both.rank, both.world), (1, 2));
        let torchrun = launch(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")])?;
        assert!(!torchrun.is_distributed());
        Ok(())
    }

    #[test]
    fn a_bad_launch_is_named() {
        let e = |vars: &[(&str, &str)]| match launch(vars) {
            Ok(l) => panic!("{vars:?} gave {l:?}"),
            Err(e) => e.to_string(),
        };
        let msg = e(&[("PMI_RANK", "2"), ("PMI_SIZE", "2")]);
        assert!(
            msg.contains("PMI_RANK=2") && msg.contains("PMI_SIZE=2"),
            "{msg}"
        );
        let msg = e(&[("SLURM_PROCID", "x"), ("SLURM_NTASKS", "2")]);
        assert!(msg.contains("SLURM_PROCID=`x`"), "{msg}");
        let msg = e(&[("OMPI_COMM_WORLD_RANK", "0")]);
        assert!(msg.contains("OMPI_COMM_WORLD_SIZE is not"), "{msg}");
    }
}
