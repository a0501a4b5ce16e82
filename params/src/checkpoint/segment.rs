//! A segment as one candle custom op (1 to 3 inputs), cut from the graph around it: either
//! recomputed in backward from its inputs (`full`), or with its graph kept from forward and
//! dropped as soon as its backward has run (`blocks`).

use std::sync::{Arc, Mutex};

use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Device, Layout, Shape, Storage,
    Tensor, TensorId, Var,
};

use ft_kernels::grad_tap;

use super::sink::locked;
use super::{GradSink, SegmentFn};

/// A segment's graph built in forward: its own input leaves (a `Var` per tracked input, whose
/// gradient backward hands on; `None` where the input needs none) and its output.
pub(crate) struct KeptGraph {
    pub(crate) leaves: Vec<Option<Var>>,
    pub(crate) y: Tensor,
}

/// How backward gets the segment's graph.
pub(crate) enum Body {
    /// Recomputed from the detached inputs; with `sizes`, what the segment would hold kept is
    /// written at `index` (the budget strategy's first step).
    Recompute {
        f: SegmentFn,
        inputs: Vec<Tensor>,
        sizes: Option<Arc<Mutex<Vec<Option<u64>>>>>,
        index: usize,
        /// `full-host`: the inputs are in host memory and the segment runs on this device
        /// (brought there for the forward and again for the recompute; the output and the
        /// input gradients go back to the host).
        device: Option<Device>,
    },
    /// Built in forward and taken (so freed) by backward.
    Kept(Mutex<Option<KeptGraph>>),
}

pub(crate) struct SegmentOp {
    pub(crate) body: Body,
    /// Per input, whether backward returns a gradient for it (it is tracked as the op's
    /// argument: a rebuilt graph copies it as a leaf).
    pub(crate) tracked: Vec<bool>,
    /// Per input, whether its gradient is needed by the model (tracked before the segment
    /// made its first input a variable so that it is recorded at all): the inputs a kept
    /// graph copies as its leaves, and so what the budget strategy counts.
    pub(crate) copied: Vec<bool>,
    pub(crate) params: Vec<Var>,
    pub(crate) sink: GradSink,
}

/// Bytes held by the graph behind `y`: every tensor on a path from `y` to a variable, each
/// storage counted once however many views share it. Storage a variable owns is not counted,
/// even through a view of it (a weight reshaped for a broadcast, a segment's input leaf): it is
/// a parameter, or a segment's copy of its input, which `SegmentBytes::inputs` counts. Tensors off those paths (masks,
/// constants) are not counted either: backward does not visit them, and they are small next to
/// the activations in the models here.
pub fn graph_bytes(y: &Tensor) -> u64 {
    graphs_bytes(&[y])
}

/// [`graph_bytes`] over several graphs at once, storage they share counted once: what a
/// forward under `blocks` holds in the caller's graph and the segments' kept graphs together.
pub fn graphs_bytes(ys: &[&Tensor]) -> u64 {
    let key = |t: &Tensor| &*t.storage_and_layout().0 as *const Storage as usize;
    let nodes: Vec<&Tensor> = ys.iter().flat_map(|y| y.sorted_nodes()).collect();
    let owned: std::collections::HashSet<usize> = nodes
        .iter()
        .filter(|n| n.is_variable())
        .map(|n| key(n))
        .collect();
    let mut seen: std::collections::HashMap<usize, u64> = std::collections::HashMap::new();
    for node in &nodes {
        let k = key(node);
        if node.is_variable() || !node.is_contiguous() || owned.contains(&k) {
            continue;
        }
        let end = ((node.layout().start_offset() + node.elem_count())
            * node.dtype().size_in_bytes()) as u64;
        let e = seen.entry(k).or_default();
        *e = (*e).max(end);
    }
    seen.values().sum()
}

impl SegmentOp {
    /// The output as a fresh contiguous tensor: the recomputing body evaluates the segment on
    /// the detached inputs (its graph dies when this returns); the kept body hands out its
    /// output, whose graph stays with it.
    fn forward(&self) -> candle_core::Result<Tensor> {
        let y = match &self.body {
            Body::Recompute {
                f,
                inputs,
                device: Some(d),
                ..
            } => f(&on(inputs, d)?)?.to_device(&Device::Cpu)?,
            Body::Recompute { f, inputs, .. } => f(inputs)?,
            Body::Kept(kept) => match &*locked(kept) {
                Some(k) => k.y.clone(),
                None => candle_core::bail!("checkpointed segment: forward after backward"),
            },
        };
        let exact = y.is_contiguous() && y.layout().start_offset() == 0;
        Ok(if exact { y } else { y.force_contiguous()? })
    }

    /// The segment's graph for backward: rebuilt on fresh `Var` copies of the inputs, or the
    /// one kept from forward (taken, so that it is freed when backward is done with it).
    fn graph(&self) -> candle_core::Result<KeptGraph> {
        match &self.body {
            Body::Kept(kept) => locked(kept).take().ok_or_else(|| {
                candle_core::Error::Msg("checkpointed segment: backward ran twice".into())
            }),
            Body::Recompute {
                f,
                inputs,
                sizes,
                index,
                device,
            } => {
                let inputs = match device {
                    Some(d) => on(inputs, d)?,
                    None => inputs.clone(),
                };
                let (leaves, xs) = leaves_for(&inputs, &self.tracked)?;
                let op_kept = ft_kernels::op_kept::added();
                let y = f(&xs)?;
                let op_kept = ft_kernels::op_kept::added() - op_kept;
                if let Some(sizes) = sizes {
                    // What the segment holds when kept: its graph, what its ops keep beside
                    // it and the input copies a kept graph makes.
                    let copies: Vec<Option<Var>> = leaves
                        .iter()
                        .zip(&self.copied)
                        .map(|(v, c)| v.clone().filter(|_| *c))
                        .collect();
                    let mut c = locked(sizes);
                    if c.len() <= *index {
                        c.resize(*index + 1, None);
                    }
                    c[*index] = Some(graph_bytes(&y) + op_kept + copies_bytes(&copies));
                }
                Ok(KeptGraph { leaves, y })
            }
        }
    }

    fn backward(&self, grad_out: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let KeptGraph { leaves, y } = self.graph()?;
        let host = matches!(
            self.body,
            Body::Recompute {
                device: Some(_),
                ..
            }
        );
        let grad_out = grad_out.detach().to_device(y.device())?;
        // What the tap already holds for this segment's parameters came from ops outside it
        // (after it in the forward): set aside while its backward runs, so that it hands on
        // only the gradients it formed, and a parameter used inside and outside it is still
        // refused under an early step whatever the order of the backward.
        let outside: Vec<(TensorId, Tensor)> = self
            .params
            .iter()
            .filter_map(|p| grad_tap::take(p.id()).map(|g| (p.id(), g)))
            .collect();
        let surrogate = super::seed::seeded(&y, &grad_out)?;
        let mut grads = surrogate.backward()?;
        drop(surrogate);
        let mut finished = Vec::with_capacity(self.params.len());
        for p in &self.params {
            if let Some(g) = grad_tap::remove(&mut grads, p.as_tensor())? {
                finished.push((p.clone(), g.detach()));
            }
        }
        for (id, g) in outside {
            grad_tap::restore(id, g)?;
        }
        self.sink.finish(finished)?;
        let mut out = Vec::with_capacity(leaves.len());
        for (v, tracked) in leaves.iter().zip(&self.tracked) {
            let g = match (v, tracked) {
                (Some(v), true) => grad_tap::remove(&mut grads, v.as_tensor())?,
                _ => None,
            };
            out.push(match g {
                // Back to the host, where this op's inputs are.
                Some(g) if host => Some(g.detach().to_device(&Device::Cpu)?),
                g => g.map(|g| g.detach()),
            });
        }
        Ok(out)
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

/// A segment graph's own leaves, built the same way whether the graph is kept from forward or
/// rebuilt in backward: a `Var` copy of each (detached) input whose gradient is needed, so that
/// the graph stops there, and `None` for the others, which are read as they are. Returns the
/// leaves and the tensors to run the segment on.
pub(crate) fn leaves_for(
    inputs: &[Tensor],
    tracked: &[bool],
) -> candle_core::Result<(Vec<Option<Var>>, Vec<Tensor>)> {
    let leaves = inputs
        .iter()
        .zip(tracked)
        .map(|(t, tracked)| tracked.then(|| Var::from_tensor(t)).transpose())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let xs = leaves
        .iter()
        .zip(inputs)
        .map(|(v, x)| {
            v.as_ref()
                .map_or_else(|| x.clone(), |v| v.as_tensor().clone())
        })
        .collect();
    Ok((leaves, xs))
}

/// Bytes of a segment's input copies ([`leaves_for`]).
pub(crate) fn copies_bytes(leaves: &[Option<Var>]) -> u64 {
    leaves
        .iter()
        .flatten()
        .map(|v| crate::bytes::tensor_bytes(v.as_tensor()))
        .sum()
}

/// `xs` on `device` (the same tensors when they are there already).
fn on(xs: &[Tensor], device: &Device) -> candle_core::Result<Vec<Tensor>> {
    xs.iter().map(|x| x.to_device(device)).collect()
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
