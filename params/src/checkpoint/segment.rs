//! A checkpointed segment as one candle custom op (1 to 3 inputs): forward keeps only the
//! inputs and the output; backward recomputes the segment on `Var` copies of the inputs.

use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Storage, Tensor, Var,
};

use super::{GradSink, SegmentFn};

pub(crate) struct SegmentOp {
    pub(crate) f: SegmentFn,
    pub(crate) inputs: Vec<Tensor>,
    pub(crate) tracked: Vec<bool>,
    pub(crate) params: Vec<Var>,
    pub(crate) sink: GradSink,
}

impl SegmentOp {
    /// Forward on the detached inputs; the segment's graph dies with `y` when this returns.
    fn forward(&self) -> candle_core::Result<Tensor> {
        let y = (self.f)(&self.inputs)?;
        let exact = y.is_contiguous() && y.layout().start_offset() == 0;
        Ok(if exact { y } else { y.force_contiguous()? })
    }

    fn backward(&self, grad_out: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let vars = self
            .inputs
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let xs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = (self.f)(&xs)?;
        let surrogate = (y * grad_out.detach())?.sum_all()?;
        let mut grads = surrogate.backward()?;
        let finished = self
            .params
            .iter()
            .filter_map(|p| Some((p.clone(), grads.remove(p.as_tensor())?.detach())))
            .collect();
        self.sink.finish(finished)?;
        Ok(vars
            .iter()
            .zip(&self.tracked)
            .map(|(v, tracked)| {
                if *tracked {
                    grads.remove(v.as_tensor()).map(|g| g.detach())
                } else {
                    None
                }
            })
            .collect())
    }

    fn cpu_out(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = self.forward()?;
        let (storage, _) = y.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.clone(), y.shape().clone())),
            _ => candle_core::bail!("checkpointed segment: output is not on the CPU"),
        }
    }

    fn cuda_out(&self) -> candle_core::Result<(CudaStorage, Shape)> {
        let y = self.forward()?;
        let (storage, layout) = y.storage_and_layout();
        match storage.try_clone(layout)? {
            Storage::Cuda(s) => Ok((s, y.shape().clone())),
            _ => candle_core::bail!("checkpointed segment: output is not on a CUDA device"),
        }
    }
}

fn nth(v: &[Option<Tensor>], i: usize) -> Option<Tensor> {
    v.get(i).cloned().flatten()
}

impl CustomOp1 for SegmentOp {
    fn name(&self) -> &'static str {
        "checkpointed-segment"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu_out()
    }
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.cuda_out()
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(nth(&self.backward(g)?, 0))
    }
}

impl CustomOp2 for SegmentOp {
    fn name(&self) -> &'static str {
        "checkpointed-segment"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu_out()
    }
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.cuda_out()
    }
    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let v = self.backward(g)?;
        Ok((nth(&v, 0), nth(&v, 1)))
    }
}

impl CustomOp3 for SegmentOp {
    fn name(&self) -> &'static str {
        "checkpointed-segment"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu_out()
    }
    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.cuda_out()
    }
    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let v = self.backward(g)?;
        Ok((nth(&v, 0), nth(&v, 1), nth(&v, 2)))
    }
}
