//! AdamW with 8-bit moments, blockwise as bitsandbytes' `AdamW8bit` stores them: each block of
//! 256 values keeps one fp32 absolute maximum, and each value one byte indexing bitsandbytes'
//! dynamic quantization map (signed for the first moment, unsigned for the second). The state
//! is about 2.03 bytes per parameter instead of 8; tensors under 4,096 elements keep fp32
//! moments, as bitsandbytes does (`min_8bit_size`).
//!
//! Each step dequantizes a block, applies exactly the fp32 AdamW update of
//! [`super::AdamW`] (the same per-element arithmetic), then quantizes the new moments
//! against the block's new maximum. Parameters on the host (a CPU run, or a GPU model with
//! `--offload-optimizer`) are updated in threaded passes over blocks; parameters on a GPU by
//! one CUDA kernel launch per tensor (`ft_kernels::cuda::adamw8bit_fused`, one CUDA block per
//! quantization block), with the codes and maxima beside the weights, as bitsandbytes keeps
//! them. The two paths compute alike: the same map and nearest-value rule, and the kernel's
//! per-element arithmetic is the host's operation for operation (rounded intrinsics, no FMA
//! contraction), so a GPU step is meant to give the host's bits.

use candle_core::{DType, Device, Tensor, Var};

use rayon::prelude::*;

mod quant;

pub use quant::{dynamic_map, nearest};

use ft_kernels::host::CHUNK;
use quant::{maps, quantize};

use super::host_adamw::{element, HostStep};
use super::rules::WriteRules;
use super::spec::OptimSpec;
use super::{AdamWConfig, Optimizer};
use crate::error::{Error, Result};

/// Values per quantization block (one fp32 maximum each).
pub const BLOCK: usize = 256;
// A parallel task holds whole blocks.
const _: () = assert!(CHUNK.is_multiple_of(BLOCK));

/// Tensors with fewer elements keep fp32 moments.
pub const MIN_8BIT_SIZE: usize = 4096;

/// `--optim adamw8bit` (also `adamw_8bit`, `adamw_bnb_8bit`): on a GPU its update exists only
/// as this crate's kernel, so without it the state must be offloaded (`--offload-optimizer`).
pub const SPEC: OptimSpec = OptimSpec {
    names: &["adamw8bit", "adamw_8bit", "adamw_bnb_8bit"],
    state_label: "AdamW moments (8-bit blocks, fp32 under 4,096 values)",
    state_bytes: |dims| {
        let numel: usize = dims.iter().product();
        if numel >= MIN_8BIT_SIZE {
            2 * numel as u64 + 2 * 4 * numel.div_ceil(BLOCK) as u64
        } else {
            8 * numel as u64
        }
    },
    // The new quantized moments and fp32 weights before they are set, and the blocks' new
    // scales; fp32 moments (small tensors) as AdamW's op by op.
    step_bytes: |dims| {
        let numel: usize = dims.iter().product();
        if numel >= MIN_8BIT_SIZE {
            8 * numel as u64 + 16 * numel.div_ceil(BLOCK) as u64
        } else {
            20 * numel as u64
        }
    },
    in_place_on_gpu: true,
    build: |n, s| {
        Box::new(AdamW8bit::new(
            n,
            AdamWConfig {
                weight_decay: s.weight_decay,
                ..AdamWConfig::default()
            },
        ))
    },
    gpu_needs_kernels: true,
};

/// Moments of one parameter: fp32 tensors, or 8-bit codes with per-block maxima. Restored one
/// named tensor at a time, so each part is optional until the first step.
#[derive(Default, Clone)]
struct Slot {
    m: Option<Tensor>,
    v: Option<Tensor>,
    m_max: Option<Tensor>,
    v_max: Option<Tensor>,
}

/// AdamW with blockwise 8-bit moments (bitsandbytes' `AdamW8bit` with `torch.optim.AdamW`'s
/// update).
pub struct AdamW8bit {
    cfg: AdamWConfig,
    t: u64,
    slots: Vec<Slot>,
    /// Stochastic rounding and weight-decay exemptions (`Optimizer::rules`).
    rules: WriteRules,
    /// Both maps on the GPU (signed, then unsigned: 512 fp32 values) once a CUDA step ran.
    #[cfg(feature = "cuda")]
    device_maps: Option<Tensor>,
}

impl AdamW8bit {
    pub fn new(n_params: usize, cfg: AdamWConfig) -> Self {
        AdamW8bit {
            cfg,
            t: 0,
            slots: vec![Slot::default(); n_params],
            rules: WriteRules::default(),
            #[cfg(feature = "cuda")]
            device_maps: None,
        }
    }
}

/// Readies a quantized parameter's codes and maxima on `dev` for the CUDA step: zeros before
/// the first step (returns true, so the kernel ignores them), as they are when already there,
/// otherwise the restored state checked and mapped on the host (`restored_q8`) and uploaded.
#[cfg(feature = "cuda")]
fn codes_on(slot: &mut Slot, i: usize, n: usize, dev: &Device) -> Result<bool> {
    let blocks = n.div_ceil(BLOCK);
    let ready = |t: &Option<Tensor>, dt: DType, len: usize| {
        t.as_ref().is_some_and(|t| {
            t.dtype() == dt
                && t.elem_count() == len
                && t.is_contiguous()
                && t.device().same_device(dev)
        })
    };
    if ready(&slot.m, DType::U8, n)
        && ready(&slot.v, DType::U8, n)
        && ready(&slot.m_max, DType::F32, blocks)
        && ready(&slot.v_max, DType::F32, blocks)
    {
        return Ok(false);
    }
    let Some((m, m_max, v, v_max)) = restored_q8(slot, i, n)? else {
        // Zeros the kernel ignores at the first step (allocated on the device, no host copy).
        slot.m = Some(Tensor::zeros(n, DType::U8, dev)?);
        slot.v = Some(Tensor::zeros(n, DType::U8, dev)?);
        slot.m_max = Some(Tensor::zeros(blocks, DType::F32, dev)?);
        slot.v_max = Some(Tensor::zeros(blocks, DType::F32, dev)?);
        return Ok(true);
    };
    slot.m = Some(Tensor::from_vec(m, n, dev)?);
    slot.v = Some(Tensor::from_vec(v, n, dev)?);
    slot.m_max = Some(Tensor::from_vec(m_max, blocks, dev)?);
    slot.v_max = Some(Tensor::from_vec(v_max, blocks, dev)?);
    Ok(false)
}

fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

fn codes(t: &Tensor) -> Result<Vec<u8>> {
    Ok(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?)
}

/// One parameter's 8-bit update over all its blocks, threaded: returns the new weight, both
/// moments' codes and both moments' block maxima.
type Q8Out = (Vec<f32>, Vec<u8>, Vec<f32>, Vec<u8>, Vec<f32>);

/// The moments of one parameter as the update reads them.
struct Q8In<'a> {
    m: &'a [u8],
    m_max: &'a [f32],
    v: &'a [u8],
    v_max: &'a [f32],
}

fn step_q8(p: &[f32], g: &[f32], prev: Option<Q8In<'_>>, s: &HostStep) -> Q8Out {
    let n = p.len();
    let blocks = n.div_ceil(BLOCK);
    let (mut np, mut mq, mut vq) = (vec![0f32; n], vec![0u8; n], vec![0u8; n]);
    let (mut mmax, mut vmax) = (vec![0f32; blocks], vec![0f32; blocks]);
    let (smap, umap) = maps();
    let c = s.consts();
    // Tasks of whole blocks: CHUNK elements, CHUNK / BLOCK maxima each.
    let (e, per_task) = (CHUNK, CHUNK / BLOCK);
    let work = |b0: usize,
                np: &mut [f32],
                mq: &mut [u8],
                vq: &mut [u8],
                mm: &mut [f32],
                vm: &mut [f32]| {
        let (mut mb, mut vb) = ([0f32; BLOCK], [0f32; BLOCK]);
        for (j, (mmax, vmax)) in mm.iter_mut().zip(vm.iter_mut()).enumerate() {
            let at = (b0 + j) * BLOCK;
            let len = BLOCK.min(n - at);
            let local = j * BLOCK;
            for k in 0..len {
                let i = at + k;
                let (m, v) = match &prev {
                    Some(q) => (
                        Some(smap[q.m[i] as usize] * q.m_max[b0 + j]),
                        Some(umap[q.v[i] as usize] * q.v_max[b0 + j]),
                    ),
                    None => (None, None),
                };
                let (w, m, v) = element(p[i], g[i], m, v, &c);
                np[local + k] = w;
                (mb[k], vb[k]) = (m, v);
            }
            *mmax = quantize(smap, &mb[..len], &mut mq[local..local + len]);
            *vmax = quantize(umap, &vb[..len], &mut vq[local..local + len]);
        }
    };
    np.par_chunks_mut(e)
        .zip(mq.par_chunks_mut(e))
        .zip(vq.par_chunks_mut(e))
        .zip(mmax.par_chunks_mut(per_task))
        .zip(vmax.par_chunks_mut(per_task))
        .enumerate()
        .for_each(|(t, ((((np, mq), vq), mm), vm))| work(t * per_task, np, mq, vq, mm, vm));
    (np, mq, mmax, vq, vmax)
}

impl Optimizer for AdamW8bit {
    fn n_params(&self) -> usize {
        self.slots.len()
    }

    /// Threaded passes over the blocks of host parameters (every parameter must be there).
    fn step_host(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
    ) -> Result<()> {
        if let Some(p) = params.iter().find(|p| !p.device().is_cpu()) {
            return Err(Error::Invalid(format!(
                "8-bit AdamW: a parameter of shape {:?} is on {:?}, where its update needs this \
                 crate's CUDA kernels (built with --features cuda, FT_CUDA_KERNELS not off) \
                 and every parameter contiguous fp32 on the GPU; or add --offload-optimizer to \
                 update on the host",
                p.dims(),
                p.device()
            )));
        }
        self.t += 1;
        let c = self.cfg;
        let s = HostStep {
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            lr,
            weight_decay: c.weight_decay,
            step_size: lr / (1.0 - c.beta1.powi(self.t as i32)),
            bc2_sqrt: (1.0 - c.beta2.powi(self.t as i32)).sqrt(),
            grad_mul,
        };
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let n = p.elem_count();
            let (shape, dev) = (p.shape().clone(), Device::Cpu);
            // Borrowed, not copied, when already contiguous fp32 on the host (the masters are).
            let pt = p.as_tensor().to_dtype(DType::F32)?.contiguous()?;
            let gt = g
                .to_device(&Device::Cpu)?
                .to_dtype(DType::F32)?
                .contiguous()?;
            if gt.elem_count() != n {
                return Err(Error::Invalid(format!(
                    "parameter {i}: gradient of {} elements for {n} weights",
                    gt.elem_count()
                )));
            }
            let s = HostStep {
                weight_decay: self.rules.wd(i, c.weight_decay),
                ..s
            };
            let slot = &mut self.slots[i];
            let new_w = ft_kernels::host::with_f32(&pt, |pv| {
                ft_kernels::host::with_f32(&gt, |gv| update(slot, i, pv, gv, &shape, &s))
            })
            .flatten()
            .ok_or_else(|| Error::Invalid(format!("parameter {i}: not host fp32 values")))??;
            let new_w = Tensor::from_vec(new_w, &shape, &dev)?.to_device(p.device())?;
            super::write::write_param(p, &new_w, self.rules.sr(), self.t, i)?;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn has_kernels(&self) -> bool {
        true
    }

    /// The update on CUDA: per quantized parameter one `ft_kernels::cuda::adamw8bit_fused`
    /// launch, which reads and writes the codes and block maxima beside the weights (about 2.03
    /// bytes per weight) and the master and model weight in the same pass; per small parameter
    /// the fp32-moment kernel. State restored on the host (a checkpoint) or as fp32 moments (a
    /// checkpoint of the 32-bit AdamW) goes through the host path's checks and maps once, then
    /// stays on the GPU.
    #[cfg(feature = "cuda")]
    fn step_fused(
        &mut self,
        params: &[Var],
        grads: &[Option<Tensor>],
        lr: f64,
        grad_mul: f64,
        model: Option<&[Var]>,
    ) -> Result<()> {
        self.t += 1;
        let base = super::adamw::cuda_step(&self.cfg, self.t, lr, grad_mul);
        for (i, (p, g)) in params.iter().zip(grads).enumerate() {
            let Some(g) = g else { continue };
            let (n, dev) = (p.elem_count(), p.device());
            if g.elem_count() != n {
                return Err(Error::Invalid(format!(
                    "parameter {i}: gradient of {} elements for {n} weights",
                    g.elem_count()
                )));
            }
            let w = model.map(|ms| ms[i].as_tensor());
            let seed = super::write::kernel_seed(p, self.rules.sr(), self.t, i);
            let base = ft_kernels::cuda::AdamWStep {
                weight_decay: self.rules.wd(i, self.cfg.weight_decay),
                seed,
                ..base
            };
            let slot = &mut self.slots[i];
            if n < MIN_8BIT_SIZE {
                restored_fp32(slot, i, n)?;
                for t in [&mut slot.m, &mut slot.v] {
                    if let Some(x) = t.as_ref().filter(|x| !x.device().same_device(dev)) {
                        *t = Some(x.to_device(dev)?);
                    }
                }
                super::adamw::fused_fp32_moments(p, g, &mut slot.m, &mut slot.v, w, &base)?;
                continue;
            }
            let first = codes_on(slot, i, n, dev)?;
            let maps = match &self.device_maps {
                Some(t) if t.device().same_device(dev) => t.clone(),
                _ => {
                    let (smap, umap) = maps();
                    let t = Tensor::from_iter(smap.iter().chain(umap).copied(), dev)?;
                    self.device_maps = Some(t.clone());
                    t
                }
            };
            let slot = &self.slots[i];
            let (Some(m), Some(v), Some(m_max), Some(v_max)) =
                (&slot.m, &slot.v, &slot.m_max, &slot.v_max)
            else {
                return Err(only_one(i));
            };
            let q = ft_kernels::cuda::Moments8bit {
                m,
                v,
                m_max,
                v_max,
                maps: &maps,
            };
            let step = ft_kernels::cuda::AdamWStep { first, ..base };
            let g = g.detach().contiguous()?;
            if p.dtype() == DType::F32 {
                ft_kernels::cuda::adamw8bit_fused(p.as_tensor(), &q, &g, w, &step)?;
            } else {
                ft_kernels::cuda::adamw8bit_fused_in_place(p.as_tensor(), &q, &g, &step)?;
            }
        }
        Ok(())
    }

    fn rules(&mut self) -> &mut WriteRules {
        &mut self.rules
    }

    fn state(&self) -> (u64, Vec<(String, Tensor)>) {
        let kinds = [
            "exp_avg",
            "exp_avg_sq",
            "exp_avg_absmax",
            "exp_avg_sq_absmax",
        ];
        let out = super::state::named_state(&kinds, &self.slots, |s, k| {
            [&s.m, &s.v, &s.m_max, &s.v_max][k].as_ref()
        });
        (self.t, out)
    }

    fn load_state(&mut self, step: u64, tensors: &[(String, Tensor)]) -> Result<()> {
        self.t = step;
        let n = self.slots.len();
        for (name, t) in tensors {
            let Some((kind, i)) = super::state::state_name(name, n)? else {
                continue;
            };
            let slot = &mut self.slots[i];
            let part = match kind {
                "exp_avg" => &mut slot.m,
                "exp_avg_sq" => &mut slot.v,
                "exp_avg_absmax" => &mut slot.m_max,
                "exp_avg_sq_absmax" => &mut slot.v_max,
                _ => continue,
            };
            // A copy on the host: nothing of the caller's is kept.
            *part = Some(t.to_device(&Device::Cpu)?.copy()?);
        }
        Ok(())
    }
}

/// One parameter's update from its weights `pv` and gradient `gv` (host fp32 values): the new
/// weights; the moments in `slot` are replaced by the updated ones.
fn update(
    slot: &mut Slot,
    i: usize,
    pv: &[f32],
    gv: &[f32],
    shape: &candle_core::Shape,
    s: &HostStep,
) -> Result<Vec<f32>> {
    let n = pv.len();
    let dev = Device::Cpu;
    let quantized = n >= MIN_8BIT_SIZE;
    Ok(if quantized {
        let out = match restored_q8(slot, i, n)? {
            None => step_q8(pv, gv, None, s),
            Some((m, m_max, v, v_max)) => {
                let q = Q8In {
                    m: &m,
                    m_max: &m_max,
                    v: &v,
                    v_max: &v_max,
                };
                step_q8(pv, gv, Some(q), s)
            }
        };
        let (w, mq, mmax, vq, vmax) = out;
        let blocks = mmax.len();
        slot.m = Some(Tensor::from_vec(mq, n, &dev)?);
        slot.v = Some(Tensor::from_vec(vq, n, &dev)?);
        slot.m_max = Some(Tensor::from_vec(mmax, blocks, &dev)?);
        slot.v_max = Some(Tensor::from_vec(vmax, blocks, &dev)?);
        w
    } else {
        restored_fp32(slot, i, n)?;
        let restored = |t: &Option<Tensor>| t.as_ref().map(host_f32).transpose();
        let (m, v) = (restored(&slot.m)?, restored(&slot.v)?);
        let mut w = vec![0f32; n];
        let (mut nm, mut nv) = (vec![0f32; n], vec![0f32; n]);
        let c = s.consts();
        for k in 0..n {
            (w[k], nm[k], nv[k]) = element(
                pv[k],
                gv[k],
                m.as_ref().map(|m| m[k]),
                v.as_ref().map(|v| v[k]),
                &c,
            );
        }
        slot.m = Some(Tensor::from_vec(nm, shape, &dev)?);
        slot.v = Some(Tensor::from_vec(nv, shape, &dev)?);
        w
    })
}

/// Host codes and block maxima of both moments (first-moment codes, their maxima, second-moment
/// codes, their maxima) of a quantized parameter of `n` weights: `None` before its first
/// step; restored state checked against `n`.
type Q8Host = (Vec<u8>, Vec<f32>, Vec<u8>, Vec<f32>);

fn restored_q8(slot: &Slot, i: usize, n: usize) -> Result<Option<Q8Host>> {
    let (m, v) = match (&slot.m, &slot.v) {
        (None, None) => return Ok(None),
        (Some(m), Some(v)) => (m, v),
        _ => return Err(only_one(i)),
    };
    let (m, m_max) = slot_codes(i, m, &slot.m_max, true)?;
    let (v, v_max) = slot_codes(i, v, &slot.v_max, false)?;
    let blocks = n.div_ceil(BLOCK);
    if m.len() != n || v.len() != n || m_max.len() != blocks || v_max.len() != blocks {
        return Err(Error::Invalid(format!(
            "parameter {i}: restored 8-bit moments do not match {n} weights"
        )));
    }
    Ok(Some((m, m_max, v, v_max)))
}

fn only_one(i: usize) -> Error {
    Error::Invalid(format!("parameter {i}: only one AdamW moment was restored"))
}

/// Checks the fp32 moments of a small (unquantized) parameter of `n` weights: both or neither,
/// of `n` values, not 8-bit codes.
fn restored_fp32(slot: &Slot, i: usize, n: usize) -> Result<()> {
    for t in [&slot.m, &slot.v].into_iter().flatten() {
        if t.dtype() == DType::U8 || t.elem_count() != n {
            return Err(Error::Invalid(format!(
                "parameter {i}: restored moment of {:?} x {} for {n} fp32 values \
                 (a checkpoint of another model or optimizer?)",
                t.dtype(),
                t.elem_count()
            )));
        }
    }
    if slot.m.is_some() != slot.v.is_some() {
        return Err(only_one(i));
    }
    Ok(())
}

/// A restored moment as codes and block maxima: 8-bit codes with their maxima, or fp32 values
/// (a checkpoint of the 32-bit AdamW) quantized here with the first (`signed`) or second
/// moment's map.
fn slot_codes(
    i: usize,
    t: &Tensor,
    max: &Option<Tensor>,
    signed: bool,
) -> Result<(Vec<u8>, Vec<f32>)> {
    match (t.dtype(), max) {
        (DType::U8, Some(max)) => Ok((codes(t)?, host_f32(max)?)),
        (DType::U8, None) => Err(Error::Invalid(format!(
            "parameter {i}: 8-bit moments restored without their block maxima"
        ))),
        _ => {
            let values = host_f32(t)?;
            let map = if signed { &maps().0 } else { &maps().1 };
            let mut codes = vec![0u8; values.len()];
            let maxima = values
                .chunks(BLOCK)
                .zip(codes.chunks_mut(BLOCK))
                .map(|(v, c)| quantize(map, v, c))
                .collect();
            Ok((codes, maxima))
        }
    }
}
