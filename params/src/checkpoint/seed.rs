//! Starting a segment's backward from its output's gradient.
//!
//! candle's backward starts from a scalar. The segment's backward used `sum(y * dy)` for one,
//! whose backward makes `dy` back the long way: the product and the sum in forward, then in
//! backward a broadcast of the scalar's gradient to `y`'s shape, a zero-filled slot and an add
//! for the product, the product's own backward (`ones * dy`), and a zero-filled slot and an add
//! for `y`: eight tensors of the segment output's size, for a gradient that is `dy` itself.
//! [`seeded`] is a scalar whose backward hands `dy` to `y` as it is (candle still fills `y`'s
//! slot with zeros and adds it: `0 + dy`, the value the long way gave too).

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// The scalar op: forward a zero, backward `dy`.
struct Seed {
    dy: Tensor,
}

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "ft-backward-seed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let zero = Tensor::zeros((), s.dtype(), &candle_core::Device::Cpu)?;
        let (storage, _) = zero.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cpu(c) => Ok((c.clone(), Shape::from(()))),
            _ => candle_core::bail!("backward seed: a CPU zero not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let dev = candle_core::Device::Cuda(s.device().clone());
        let zero = Tensor::zeros((), s.dtype(), &dev)?;
        let (storage, layout) = zero.storage_and_layout();
        match storage.try_clone(layout)? {
            candle_core::Storage::Cuda(c) => Ok((c, Shape::from(()))),
            _ => candle_core::bail!("backward seed: a CUDA zero not on CUDA"),
        }
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, _grad: &Tensor) -> Result<Option<Tensor>> {
        if self.dy.shape() != arg.shape() || self.dy.dtype() != arg.dtype() {
            candle_core::bail!(
                "backward seed: a gradient {:?} {:?} for an output {:?} {:?}",
                self.dy.shape(),
                self.dy.dtype(),
                arg.shape(),
                arg.dtype()
            );
        }
        Ok(Some(self.dy.clone()))
    }
}

/// A scalar whose `backward()` gives `y` the gradient `dy` (same shape, dtype and device; the
/// scalar's own gradient, 1, is not applied).
pub(crate) fn seeded(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    y.apply_op1(Seed { dy: dy.detach() })
}
