//! The collectives over MPI (the `mpi` crate over the system's OpenMPI or MPICH).

use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use crate::element::Element;
use crate::error::{DistError, Result};
use crate::launch::Launch;

/// The most elements one message carries: MPI counts them in an i32.
const MESSAGE: usize = i32::MAX as usize;

/// MPI's world; MPI is finalised when this is dropped.
pub(crate) struct Mpi {
    world: SimpleCommunicator,
    _universe: mpi::environment::Universe,
}

impl Mpi {
    /// Initialises MPI and checks that its world is the launch's: a binary built against one
    /// MPI and started by another's launcher sees a world of one.
    pub fn init(launch: &Launch) -> Result<Self> {
        let universe = mpi::initialize().ok_or_else(|| {
            DistError::Unsupported("MPI was initialised twice in one process".into())
        })?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        if (rank, size) != (launch.rank, launch.world) {
            return Err(DistError::Launch(format!(
                "{} says rank {} of {}, MPI says rank {rank} of {size}: the binary was built \
                 against another MPI than the launcher's (rebuild it where `mpicc` is the \
                 launcher's)",
                launch.launcher, launch.rank, launch.world
            )));
        }
        Ok(Mpi {
            world,
            _universe: universe,
        })
    }

    pub fn all_reduce_sum<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        // MPI's all-reduce reads and writes separate buffers.
        let send = buf.to_vec();
        self.world
            .all_reduce_into(&send[..], buf, SystemOperation::sum());
        Ok(())
    }

    pub fn reduce_sum<T: Element>(&self, buf: &mut [T], root: usize, me: usize) -> Result<()> {
        let at = self.world.process_at_rank(root as i32);
        if me == root {
            let send = buf.to_vec();
            at.reduce_into_root(&send[..], buf, SystemOperation::sum());
        } else {
            at.reduce_into(&buf[..], SystemOperation::sum());
        }
        Ok(())
    }

    pub fn reduce_scatter_sum<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.world
            .reduce_scatter_block_into(send, recv, SystemOperation::sum());
        Ok(())
    }

    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.world.all_gather_into(send, recv);
        Ok(())
    }

    /// In messages of at most [`MESSAGE`] elements: a buffer may be longer than MPI's i32
    /// count (the ranks' tensors travel as bytes, 2 GiB of them in one fp32 tensor of 537M
    /// values).
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let at = self.world.process_at_rank(root as i32);
        for piece in buf.chunks_mut(MESSAGE) {
            at.broadcast_into(piece);
        }
        Ok(())
    }

    /// In messages of at most [`MESSAGE`] elements, as [`Self::broadcast`] (a gathered tensor
    /// travels as bytes); an empty buffer is one empty message.
    pub fn send<T: Element>(&self, buf: &[T], to: usize) -> Result<()> {
        let at = self.world.process_at_rank(to as i32);
        match buf.is_empty() {
            true => at.send(buf),
            false => buf.chunks(MESSAGE).for_each(|piece| at.send(piece)),
        }
        Ok(())
    }

    /// What [`Self::send`] sent, in the same pieces.
    pub fn recv<T: Element>(&self, buf: &mut [T], from: usize) -> Result<()> {
        if buf.is_empty() {
            return self.recv_message(buf, from);
        }
        buf.chunks_mut(MESSAGE)
            .try_for_each(|piece| self.recv_message(piece, from))
    }

    fn recv_message<T: Element>(&self, buf: &mut [T], from: usize) -> Result<()> {
        // The message's length is read before it is taken: a longer one received into `buf`
        // would be MPI's truncation error, which ends the job.
        let (msg, status) = self.world.process_at_rank(from as i32).matched_probe();
        let got = status.count(T::equivalent_datatype()) as usize;
        if got != buf.len() {
            // Taken into a buffer of its own length, so that it leaves the queue.
            let mut other = vec![T::default(); got];
            msg.matched_receive_into(&mut other[..]);
            return Err(DistError::Shape(format!(
                "recv: {got} values from rank {from}, {} expected",
                buf.len()
            )));
        }
        msg.matched_receive_into(buf);
        Ok(())
    }

    pub fn barrier(&self) {
        self.world.barrier();
    }

    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}
