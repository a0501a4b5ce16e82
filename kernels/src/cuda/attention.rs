//! Memory-efficient attention on CUDA (`attention.cu`; in bf16 on sm_80+ the tensor-core
//! kernels of `attention_tc.cu`): `softmax(q k^T * scale + bias) v` for 64-dim heads without
//! the Lq x Lk score matrix, forward and backward (FlashAttention-2's scheme: the forward keeps
//! one log-sum-exp per query row, the backward recomputes the probabilities tile by tile). The
//! bias (T5's relative position bias, or a mask) gets its gradient when it is part of the
//! autograd graph.
//!
//! K and V travel packed as one [B, H, Lk, 2D] tensor so that the op has the two or three
//! inputs candle's custom ops allow (q, kv, bias); `cat`'s backward splits the gradient again.
//!
//! - CPU reference: `crate::attention::sdpa` (the plain score matrix), and
//!   `crate::attention::sdpa_memory_efficient` on the CPU.
//! - GPU check: `tests/cuda/attention.rs` (`fused_attention_matches_sdpa`); logic without a
//!   GPU: `tests/emulated` (`attention_case`).
//! - Timing: `cargo run --release --features cuda -p ft-kernels --example time_attention`
//!   (and ft-trainer's `gpu_bench attention` next to PyTorch's SDPA).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};

use super::launch::{
    device_of, dptr, into_tensor, launch, out_ptr, output, suffix, tensor_ptr, zeros, Arg,
};

/// Head dimension the kernels are compiled for.
const HEAD_DIM: usize = 64;
/// Query (or key) rows per block: one thread each in the CUDA-core forward, two in the backward,
/// a warp per 16 in the tensor-core kernels.
const ROWS_PER_BLOCK: usize = 64;

/// Whether [`fused_attention`] takes these inputs: CUDA tensors of f32/bf16/f16 with 64-dim
/// heads and at most 65,535 batch x head pairs.
pub fn fused_attention_supported(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let ok_dims = match (q.dims(), k.dims(), v.dims()) {
        ([b, h, _, d], [b2, h2, lk, d2], [b3, h3, lk2, d3]) => {
            b == b2
                && b == b3
                && h == h2
                && h == h3
                && lk == lk2
                && *d == HEAD_DIM
                && *d2 == HEAD_DIM
                && *d3 == HEAD_DIM
                && b * h <= 65_535
        }
        _ => false,
    };
    ok_dims
        && super::enabled()
        && q.device().is_cuda()
        && matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && q.dtype() == k.dtype()
        && q.dtype() == v.dtype()
}

/// `softmax(q k^T * scale + bias) v` with the memory-efficient kernels; q [B, H, Lq, 64],
/// k/v [B, H, Lk, 64], `bias` broadcastable to [B, H, Lq, Lk] (computed in f32). A query row
/// whose every key is masked with -inf gives zeros.
pub fn fused_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    if !fused_attention_supported(q, k, v) {
        bail!(
            "fused attention needs CUDA f32/bf16/f16 tensors with 64-dim heads, got q {:?} k {:?} \
             v {:?} ({:?})",
            q.dims(),
            k.dims(),
            v.dims(),
            q.dtype()
        );
    }
    let q = q.contiguous()?;
    let kv = Tensor::cat(&[k, v], 3)?.contiguous()?;
    let op = FusedAttention {
        scale: scale as f32,
        lse: Mutex::new(None),
    };
    match bias {
        None => q.apply_op2(&kv, op),
        Some(b) => {
            let target = [q.dim(0)?, q.dim(1)?, q.dim(2)?, k.dim(2)?];
            let b = b.to_dtype(DType::F32)?.reshape(rank4(b.dims(), target)?)?;
            q.apply_op3(&kv, &b.contiguous()?, op)
        }
    }
}

/// `dims` left-padded with ones to rank 4, checked to broadcast to `target`.
fn rank4(dims: &[usize], target: [usize; 4]) -> Result<Vec<usize>> {
    if dims.len() > 4 {
        bail!("attention bias has rank {}, at most 4", dims.len());
    }
    let mut d = vec![1usize; 4 - dims.len()];
    d.extend_from_slice(dims);
    for (a, t) in d.iter().zip(target) {
        if *a != 1 && *a != t {
            bail!("attention bias {dims:?} does not broadcast to {target:?}");
        }
    }
    Ok(d)
}

/// Element strides of a contiguous rank-4 bias, 0 along the dimensions it broadcasts over.
fn bias_strides(dims: &[usize]) -> [i64; 4] {
    let mut s = [0i64; 4];
    let mut acc = 1i64;
    for i in (0..4).rev() {
        s[i] = if dims[i] == 1 { 0 } else { acc };
        acc *= dims[i] as i64;
    }
    s
}

struct FusedAttention {
    scale: f32,
    /// Per-row log-sum-exp of the forward, [B*H*Lq] f32, kept for the backward.
    lse: Mutex<Option<Tensor>>,
}

/// What every kernel of the op needs to know about its inputs.
struct Geometry {
    b: usize,
    h: usize,
    lq: usize,
    lk: usize,
    dtype: DType,
    q: u64,
    kv: u64,
    bias: u64,
    bias_strides: [i64; 4],
}

impl Geometry {
    fn new(q: &Layout, kv: &Layout, dtype: DType) -> Result<Self> {
        let (b, h, lq) = match q.dims() {
            [b, h, lq, d] if *d == HEAD_DIM => (*b, *h, *lq),
            d => bail!("fused attention: q {d:?} is not [B, H, Lq, {HEAD_DIM}]"),
        };
        let lk = match kv.dims() {
            [b2, h2, lk, d] if *b2 == b && *h2 == h && *d == 2 * HEAD_DIM => *lk,
            d => bail!(
                "fused attention: packed kv {d:?} does not match q {:?}",
                q.dims()
            ),
        };
        if lq > i32::MAX as usize || lk > i32::MAX as usize {
            bail!("fused attention: sequence too long");
        }
        Ok(Geometry {
            b,
            h,
            lq,
            lk,
            dtype,
            q: 0,
            kv: 0,
            bias: 0,
            bias_strides: [0; 4],
        })
    }

    fn with_bias(mut self, dims: &[usize], ptr: u64) -> Self {
        self.bias = ptr;
        self.bias_strides = bias_strides(dims);
        self
    }

    /// Address of V inside the packed kv (or dV inside dkv).
    fn second_half(&self, kv: u64) -> u64 {
        kv + (HEAD_DIM * self.dtype.size_in_bytes()) as u64
    }

    fn shape_args(&self, scale: f32) -> [Arg; 9] {
        let s = self.bias_strides;
        [
            Arg::I32(self.h as i32),
            Arg::I32(self.lq as i32),
            Arg::I32(self.lk as i32),
            Arg::I32(2 * HEAD_DIM as i32),
            Arg::F32(scale),
            Arg::I64(s[0]),
            Arg::I64(s[1]),
            Arg::I64(s[2]),
            Arg::I64(s[3]),
        ]
    }

    fn grid(&self, rows: usize) -> (u32, u32) {
        (
            rows.div_ceil(ROWS_PER_BLOCK) as u32,
            (self.b * self.h) as u32,
        )
    }
}

impl FusedAttention {
    fn forward(&self, g: Geometry, dev: &candle_core::CudaDevice) -> Result<(CudaStorage, Shape)> {
        let rows = g.b * g.h * g.lq;
        let o = output(dev, g.dtype, rows * HEAD_DIM)?;
        let lse = output(dev, DType::F32, rows)?;
        let mut args = vec![
            Arg::Ptr(g.q),
            Arg::Ptr(g.kv),
            Arg::Ptr(g.second_half(g.kv)),
            Arg::Ptr(g.bias),
            Arg::Ptr(out_ptr(&o)?),
            Arg::Ptr(out_ptr(&lse)?),
        ];
        args.extend(g.shape_args(self.scale));
        // bf16 on sm_80+: the tensor-core forward (4 warps per 64 query rows), same outputs.
        let (name, block) =
            if g.dtype == DType::BF16 && super::tensor_cores_enabled() && super::has_mma(dev) {
                ("attn_fwd_tc_bf16".to_string(), 128)
            } else {
                (
                    format!("attn_fwd_{}", suffix(g.dtype)?),
                    ROWS_PER_BLOCK as u32,
                )
            };
        launch(dev, &name, g.grid(g.lq), block, &args)?;
        let mut slot = self
            .lse
            .lock()
            .map_err(|_| candle_core::Error::Msg("fused attention: lse lock poisoned".into()))?;
        *slot = Some(into_tensor(lse, rows));
        Ok((o, Shape::from((g.b, g.h, g.lq, HEAD_DIM))))
    }

    /// dq, dkv and (when `want_dbias`) the f32 bias gradient, shaped like the bias.
    fn backward(
        &self,
        q: &Tensor,
        kv: &Tensor,
        bias: Option<&Tensor>,
        o: &Tensor,
        go: &Tensor,
        want_dbias: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let dev = device_of(q)?;
        let dt = q.dtype();
        let go = go.to_dtype(dt)?.contiguous()?;
        let o = o.contiguous()?;
        let mut g = Geometry::new(q.layout(), kv.layout(), dt)?;
        g.q = tensor_ptr(q)?;
        g.kv = tensor_ptr(kv)?;
        if let Some(b) = bias {
            g = g.with_bias(b.dims(), tensor_ptr(b)?);
        }
        let lse = self
            .lse
            .lock()
            .map_err(|_| candle_core::Error::Msg("fused attention: lse lock poisoned".into()))?
            .clone()
            .ok_or_else(|| {
                candle_core::Error::Msg("fused attention: backward before forward".into())
            })?;
        let rows = g.b * g.h * g.lq;
        let sfx = suffix(dt)?;
        // bf16 on sm_80+: the tensor-core backward kernels (same arguments, 4 warps per block);
        // else the CUDA-core ones (two threads per row). Both take 128 threads per 64 rows.
        let tc = dt == DType::BF16 && super::tensor_cores_enabled() && super::has_mma(&dev);
        let variant = if tc { "tc_bf16" } else { sfx };
        let block = 2 * ROWS_PER_BLOCK as u32;

        let delta = output(&dev, DType::F32, rows)?;
        launch(
            &dev,
            &format!("attn_delta_{sfx}"),
            (rows.div_ceil(128) as u32, 1),
            128,
            &[
                Arg::Ptr(tensor_ptr(&o)?),
                Arg::Ptr(tensor_ptr(&go)?),
                Arg::Ptr(out_ptr(&delta)?),
                Arg::I64(rows as i64),
            ],
        )?;

        let common = [
            Arg::Ptr(g.q),
            Arg::Ptr(g.kv),
            Arg::Ptr(g.second_half(g.kv)),
            Arg::Ptr(g.bias),
            Arg::Ptr(tensor_ptr(&go)?),
            Arg::Ptr(tensor_ptr(&lse)?),
            Arg::Ptr(out_ptr(&delta)?),
        ];

        let dq = output(&dev, dt, rows * HEAD_DIM)?;
        let dbias = match (bias, want_dbias) {
            (Some(b), true) => Some(zeros(&dev, DType::F32, b.elem_count())?),
            _ => None,
        };
        let mut args = common.to_vec();
        args.push(Arg::Ptr(out_ptr(&dq)?));
        args.push(Arg::Ptr(match &dbias {
            Some(d) => out_ptr(d)?,
            None => 0,
        }));
        args.extend(g.shape_args(self.scale));
        launch(
            &dev,
            &format!("attn_bwd_q_{variant}"),
            g.grid(g.lq),
            block,
            &args,
        )?;

        let dkv = output(&dev, dt, g.b * g.h * g.lk * 2 * HEAD_DIM)?;
        let dkv_ptr = out_ptr(&dkv)?;
        let mut args = common.to_vec();
        args.push(Arg::Ptr(dkv_ptr));
        args.push(Arg::Ptr(g.second_half(dkv_ptr)));
        args.extend(g.shape_args(self.scale));
        launch(
            &dev,
            &format!("attn_bwd_kv_{variant}"),
            g.grid(g.lk),
            block,
            &args,
        )?;

        let dbias = match (dbias, bias) {
            (Some(d), Some(b)) => Some(into_tensor(d, b.shape())),
            _ => None,
        };
        Ok((
            into_tensor(dq, q.shape()),
            into_tensor(dkv, kv.shape()),
            dbias,
        ))
    }
}

fn cpu_unsupported() -> Result<(CpuStorage, Shape)> {
    bail!(
        "the fused attention kernel runs on CUDA; on the CPU use attention::sdpa_memory_efficient"
    )
}

impl CustomOp2 for FusedAttention {
    fn name(&self) -> &'static str {
        "ft-fused-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_unsupported()
    }

    fn cuda_fwd(
        &self,
        qs: &CudaStorage,
        ql: &Layout,
        kvs: &CudaStorage,
        kvl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let mut g = Geometry::new(ql, kvl, qs.dtype())?;
        g.q = dptr(qs, ql)?;
        g.kv = dptr(kvs, kvl)?;
        self.forward(g, &qs.device)
    }

    fn bwd(
        &self,
        q: &Tensor,
        kv: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dq, dkv, _) = self.backward(q, kv, None, res, grad, false)?;
        Ok((Some(dq), Some(dkv)))
    }
}

impl CustomOp3 for FusedAttention {
    fn name(&self) -> &'static str {
        "ft-fused-attention-bias"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_unsupported()
    }

    fn cuda_fwd(
        &self,
        qs: &CudaStorage,
        ql: &Layout,
        kvs: &CudaStorage,
        kvl: &Layout,
        bs: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let mut g = Geometry::new(ql, kvl, qs.dtype())?;
        g.q = dptr(qs, ql)?;
        g.kv = dptr(kvs, kvl)?;
        let g = g.with_bias(bl.dims(), dptr(bs, bl)?);
        self.forward(g, &qs.device)
    }

    fn bwd(
        &self,
        q: &Tensor,
        kv: &Tensor,
        bias: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dkv, dbias) = self.backward(q, kv, Some(bias), res, grad, bias.track_op())?;
        Ok((Some(dq), Some(dkv), dbias))
    }
}
