//! The communicator a run's ranks share: one process, or MPI's world.

use crate::element::Element;
use crate::error::{DistError, Result};
use crate::launch::Launch;

/// The ranks of a run and the collectives between them. Every rank must call each collective,
/// in the same order, with buffers of the same lengths.
pub struct Comm {
    launch: Launch,
    /// The ranks' GPUs under NCCL, once [`Comm::join_gpus`] made it (dropped before `inner`).
    #[cfg(feature = "nccl")]
    gpus: std::cell::OnceCell<crate::nccl_backend::Nccl>,
    inner: Inner,
}

enum Inner {
    /// One process: every collective is the identity.
    Solo,
    #[cfg(feature = "mpi")]
    Mpi(crate::mpi_backend::Mpi),
}

impl Comm {
    /// One process, whatever the environment says.
    pub fn solo() -> Self {
        Comm {
            launch: Launch::single(),
            #[cfg(feature = "nccl")]
            gpus: Default::default(),
            inner: Inner::Solo,
        }
    }

    /// The communicator of this process's launch: one process when nothing launched it as one
    /// of several; MPI's world under `mpirun`, `mpiexec` or `srun` (with the `mpi` feature). A
    /// launch this binary cannot join is one clear error.
    pub fn from_env() -> Result<Self> {
        Self::for_launch(Launch::from_env()?)
    }

    /// The communicator of `launch` ([`Self::from_env`] with the launch given).
    pub fn for_launch(launch: Launch) -> Result<Self> {
        if !launch.is_distributed() {
            return Ok(Comm {
                launch,
                #[cfg(feature = "nccl")]
                gpus: Default::default(),
                inner: Inner::Solo,
            });
        }
        if launch.launcher == "torchrun" {
            return Err(DistError::Unsupported(format!(
                "launched by torchrun as rank {} of {}: the ranks of this toolkit talk through \
                 MPI, which torchrun does not start; launch with `mpirun -np {}` (or `srun`)",
                launch.rank, launch.world, launch.world
            )));
        }
        Self::join(launch)
    }

    #[cfg(feature = "mpi")]
    fn join(launch: Launch) -> Result<Self> {
        Ok(Comm {
            launch,
            #[cfg(feature = "nccl")]
            gpus: Default::default(),
            inner: Inner::Mpi(crate::mpi_backend::Mpi::init(&launch)?),
        })
    }

    #[cfg(not(feature = "mpi"))]
    fn join(launch: Launch) -> Result<Self> {
        Err(DistError::Unsupported(format!(
            "launched as rank {} of {} by {}, but this binary was built without the `mpi` \
             feature: rebuild it with `--features mpi` (OpenMPI or MPICH installed), or run one \
             process",
            launch.rank, launch.world, launch.launcher
        )))
    }

    pub fn rank(&self) -> usize {
        self.launch.rank
    }

    pub fn world(&self) -> usize {
        self.launch.world
    }

    /// The rank among this host's processes: the GPU this rank takes.
    pub fn local_rank(&self) -> usize {
        self.launch.local_rank
    }

    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    /// Rank 0: the one that logs, evaluates, samples and saves.
    pub fn is_main(&self) -> bool {
        self.launch.rank == 0
    }

    /// Joins the ranks' GPUs (each rank's on `stream`, its candle device's) to one NCCL
    /// communicator, which [`Self::gpus`] then returns: a collective, every rank calls it once
    /// its device is open. A second call keeps the first communicator.
    #[cfg(feature = "nccl")]
    pub fn join_gpus(&self, stream: std::sync::Arc<cudarc::driver::CudaStream>) -> Result<()> {
        if self.gpus.get().is_none() {
            let nccl = crate::nccl_backend::Nccl::join(self, stream)?;
            let _ = self.gpus.set(nccl);
        }
        Ok(())
    }

    /// The ranks' GPUs under NCCL, once [`Self::join_gpus`] joined them: where tensors on the
    /// GPU are summed without leaving it.
    #[cfg(feature = "nccl")]
    pub fn gpus(&self) -> Option<&crate::nccl_backend::Nccl> {
        self.gpus.get()
    }

    /// `buf` summed element by element over the ranks, on every rank.
    pub fn all_reduce_sum<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        match &self.inner {
            // One rank: `buf` is the sum already.
            Inner::Solo => {
                let _ = buf;
                Ok(())
            }
            #[cfg(feature = "mpi")]
            Inner::Mpi(m) => m.all_reduce_sum(buf),
        }
    }

    /// `buf` summed element by element over the ranks, into rank `root`'s `buf` alone (the other
    /// ranks' are left as they were): ZeRO-2's gradient sum, each shard to the rank that steps it.
    pub fn reduce_sum<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root("reduce_sum", root)?;
        match &self.inner {
            // One rank: it is the root, and `buf` is the sum already.
            Inner::Solo => {
                let _ = buf;
                Ok(())
            }
            #[cfg(feature = "mpi")]
            Inner::Mpi(m) => m.reduce_sum(buf, root, self.rank()),
        }
    }

    /// `send` (the world's chunks, one per rank, in rank order) summed over the ranks, each rank
    /// receiving its own chunk's sum in `recv`: ZeRO's gradient reduction.
    pub fn reduce_scatter_sum<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.check("reduce_scatter_sum", send.len(), recv.len() * self.world())?;
        match &self.inner {
            Inner::Solo => {
                recv.copy_from_slice(send);
                Ok(())
            }
            #[cfg(feature = "mpi")]
            Inner::Mpi(m) => m.reduce_scatter_sum(send, recv),
        }
    }

    /// Every rank's `send`, in rank order, in every rank's `recv`: ZeRO's weight gather.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.check("all_gather", recv.len(), send.len() * self.world())?;
        match &self.inner {
            Inner::Solo => {
                recv.copy_from_slice(send);
                Ok(())
            }
            #[cfg(feature = "mpi")]
            Inner::Mpi(m) => m.all_gather(send, recv),
        }
    }

    /// Rank `root`'s `buf` in every rank's.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root("broadcast", root)?;
        match &self.inner {
            // One rank: it is the root.
            Inner::Solo => {
                let _ = buf;
                Ok(())
            }
            #[cfg(feature = "mpi")]
            Inner::Mpi(m) => m.broadcast(buf, root),
        }
    }

    /// `buf` to rank `to`, which must call [`Self::recv`] from this rank with a buffer of the
    /// same length: what rank 0 alone needs (a checkpoint's gathered shards), without every
    /// rank receiving it as a broadcast would. Blocks until `to` takes it (for large buffers).
    pub fn send<T: Element>(&self, buf: &[T], to: usize) -> Result<()> {
        self.check_peer("send", to)?;
        match &self.inner {
            Inner::Solo => {
                let _ = buf;
                unreachable_peer()
            }
            #[cfg(feature = "mpi")]
            Inner::Mpi(m) => m.send(buf, to),
        }
    }

    /// Rank `from`'s [`Self::send`] into `buf`; a message of another length is taken and
    /// dropped, and is an error. (Over MPI a buffer past its i32 count travels in pieces,
    /// each checked: a sender longer than a receiver whose buffer ends exactly at a piece's
    /// end leaves its further pieces queued, so both sides must agree on the length, as every
    /// caller's list or header makes them.)
    pub fn recv<T: Element>(&self, buf: &mut [T], from: usize) -> Result<()> {
        self.check_peer("recv", from)?;
        match &self.inner {
            Inner::Solo => {
                let _ = buf;
                unreachable_peer()
            }
            #[cfg(feature = "mpi")]
            Inner::Mpi(m) => m.recv(buf, from),
        }
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) {
        match &self.inner {
            Inner::Solo => {}
            #[cfg(feature = "mpi")]
            Inner::Mpi(m) => m.barrier(),
        }
    }

    /// Ends every rank of the run at once, with `code` as its exit status: what a rank that
    /// failed calls, so that no other rank waits forever in a collective it will never join.
    /// One process: exits.
    pub fn abort(&self, code: i32) -> ! {
        match &self.inner {
            Inner::Solo => std::process::exit(code),
            #[cfg(feature = "mpi")]
            Inner::Mpi(m) => m.abort(code),
        }
    }

    /// Checks that every rank holds the same `bytes` (a configuration, a model's shapes): each
    /// rank's hash goes to all, so every rank stops with the same error, naming the ranks that
    /// differ from rank 0, rather than some hanging in a collective the others never call.
    pub fn agree(&self, what: &str, bytes: &[u8]) -> Result<()> {
        let mut all = vec![0u64; self.world()];
        self.all_gather(&[fnv1a(bytes)], &mut all)?;
        let differ: Vec<String> = (0..all.len())
            .filter(|&r| all[r] != all[0])
            .map(|r| r.to_string())
            .collect();
        if differ.is_empty() {
            return Ok(());
        }
        Err(DistError::Disagree(format!(
            "the ranks disagree on {what}: rank{} {} differ{} from rank 0; start every rank \
             with the same flags, configuration and model",
            if differ.len() > 1 { "s" } else { "" },
            differ.join(", "),
            if differ.len() > 1 { "" } else { "s" },
        )))
    }

    fn check_root(&self, op: &str, root: usize) -> Result<()> {
        if root >= self.world() {
            return Err(DistError::Shape(format!(
                "{op} to or from rank {root} in a world of {}",
                self.world()
            )));
        }
        Ok(())
    }

    /// A point-to-point peer: another rank of the world (one process has none).
    fn check_peer(&self, op: &str, peer: usize) -> Result<()> {
        if peer >= self.world() || peer == self.rank() {
            return Err(DistError::Shape(format!(
                "{op}: rank {peer} is not another rank of rank {}'s world of {}",
                self.rank(),
                self.world()
            )));
        }
        Ok(())
    }

    fn check(&self, op: &str, have: usize, want: usize) -> Result<()> {
        if have != want {
            return Err(DistError::Shape(format!(
                "{op}: {have} elements where a world of {} needs {want}",
                self.world()
            )));
        }
        Ok(())
    }
}

/// One process has no peer to send to or receive from: [`Comm::check_peer`] refuses every rank
/// before this is reached.
fn unreachable_peer() -> Result<()> {
    Err(DistError::Shape("one process has no other rank".into()))
}

/// FNV-1a, 64 bits: enough to tell two configurations apart, with no dependency.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_collectives_are_the_identity() -> Result<()> {
        let c = Comm::solo();
        assert_eq!((c.rank(), c.world(), c.is_main()), (0, 1, true));
        let mut x = [1.5f32, -2.0];
        c.all_reduce_sum(&mut x)?;
        assert_eq!(x, [1.5, -2.0]);
        let mut r = [0u64; 2];
        c.reduce_scatter_sum(&[3, 4], &mut r)?;
        assert_eq!(r, [3, 4]);
        c.all_gather(&[5, 6], &mut r)?;
        assert_eq!(r, [5, 6]);
        c.broadcast(&mut r, 0)?;
        assert!(c.broadcast(&mut r, 1).is_err());
        c.reduce_sum(&mut r, 0)?;
        assert_eq!(r, [5, 6]);
        assert!(c.reduce_sum(&mut r, 1).is_err());
        let e = c.reduce_scatter_sum(&[1u8, 2, 3], &mut [0u8; 2]);
        assert!(e.is_err_and(|e| e.to_string().contains("3 elements")));
        c.barrier();
        c.agree("the configuration", b"same")?;
        // One process has no peer.
        let e = c.send(&[1u8], 0).err().map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("not another rank")));
        assert!(c.recv(&mut [0u8], 1).is_err());
        Ok(())
    }

    #[test]
    fn a_launch_this_binary_cannot_join_is_one_error() {
        let launch = |launcher| Launch {
            rank: 1,
            world: 4,
            local_rank: 1,
            launcher,
        };
        let e = |l| match Comm::for_launch(l) {
            Ok(_) => panic!("{l:?} joined"),
            Err(e) => e.to_string(),
        };
        let msg = e(launch("torchrun"));
        assert!(msg.contains("mpirun -np 4"), "{msg}");
        #[cfg(not(feature = "mpi"))]
        {
            let msg = e(launch("srun"));
            assert!(
                msg.contains("--features mpi") && msg.contains("rank 1 of 4"),
                "{msg}"
            );
        }
    }

    #[test]
    fn the_hash_tells_configurations_apart() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_ne!(fnv1a(b"lr = 1e-4"), fnv1a(b"lr = 1e-5"));
    }
}
