//! Launching the kernels on candle's stream: typed arguments, grids, raw device pointers into
//! contiguous tensors, fresh output buffers, and the row and plane geometry several families
//! share.

use std::collections::HashMap;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};

use super::nvrtc::{kernel_arch, ptx};

/// One kernel argument; the variant must match the C parameter's type exactly (a pointer or
/// `long long` is 8 bytes, `int`/`float` 4).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    U64(u64),
}

thread_local! {
    /// Kernels this thread has launched (see [`launches`]).
    static LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The same by entry point (see [`launches_of`]).
    static BY_NAME: std::cell::RefCell<HashMap<String, u64>> = std::cell::RefCell::new(HashMap::new());
}

/// How many kernels whose entry point starts with `prefix` (`adamw8bit_`, `adamw_bf16_bf16`)
/// the calling thread has launched: lets a test see which path an update took.
pub fn launches_of(prefix: &str) -> u64 {
    BY_NAME.with(|m| {
        m.borrow()
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v)
            .sum()
    })
}

/// How many kernels of this crate the calling thread has launched: lets a test see that an
/// empty tensor launched nothing, which an out-of-bounds read by one stray block need not show.
pub fn launches() -> u64 {
    LAUNCHES.with(|n| n.get())
}

/// Launches `name` on `dev`'s stream with a (x, y) grid of `block`-thread blocks.
pub(crate) fn launch(
    dev: &CudaDevice,
    name: &str,
    grid: (u32, u32),
    block: u32,
    args: &[Arg],
) -> Result<()> {
    // An empty tensor launches nothing (a grid dimension of 0 is not a launch CUDA accepts,
    // and one block would index the empty buffers).
    if grid.0 == 0 || grid.1 == 0 {
        return Ok(());
    }
    LAUNCHES.with(|n| n.set(n.get() + 1));
    BY_NAME.with(|m| *m.borrow_mut().entry(name.to_string()).or_default() += 1);
    let arch = kernel_arch(dev);
    let module = format!("ft_kernels_{arch}");
    let f = dev.get_or_load_custom_func(name, &module, ptx(&arch)?)?;
    let mut b = f.builder();
    for a in args {
        match a {
            Arg::Ptr(v) | Arg::U64(v) => b.arg(v),
            Arg::I32(v) => b.arg(v),
            Arg::I64(v) => b.arg(v),
            Arg::F32(v) => b.arg(v),
        };
    }
    let cfg = LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: every entry point of the kernel files is launched through a typed wrapper of this
    // module whose `args` follow the C signature, with pointers to live, contiguous buffers of
    // the element counts the kernel indexes.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Grid size for the grid-stride element kernels: enough blocks of 256 to cover `n` once,
/// capped where every SM already has plenty of blocks.
pub(crate) fn elem_grid(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 65_535 * 4) as u32
}

/// The dtype suffix of an entry point (`softmax_fwd_bf16`).
pub(crate) fn suffix(dt: DType) -> Result<&'static str> {
    Ok(match dt {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        dt => bail!("no CUDA kernel for {dt:?} (f32, bf16 or f16)"),
    })
}

/// The device address of the first element of a contiguous storage view.
pub(crate) fn dptr(s: &CudaStorage, l: &Layout) -> Result<u64> {
    let Some((start, _)) = l.contiguous_offsets() else {
        bail!("CUDA kernel input must be contiguous");
    };
    let stream = s.device.cuda_stream();
    let (base, size) = match &s.slice {
        CudaStorageSlice::F32(x) => (x.device_ptr(&stream).0, 4),
        CudaStorageSlice::BF16(x) => (x.device_ptr(&stream).0, 2),
        CudaStorageSlice::F16(x) => (x.device_ptr(&stream).0, 2),
        CudaStorageSlice::I32(x) => (x.device_ptr(&stream).0, 4),
        CudaStorageSlice::F64(x) => (x.device_ptr(&stream).0, 8),
        CudaStorageSlice::U8(x) => (x.device_ptr(&stream).0, 1),
        _ => bail!("no CUDA kernel for {:?}", s.dtype()),
    };
    Ok(base + (start * size) as u64)
}

/// Runs `f` on the CUDA storage of `t`.
pub(crate) fn with_storage<R>(
    t: &Tensor,
    f: impl FnOnce(&CudaStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cuda(c) => f(c, l),
        _ => bail!("expected a tensor on a CUDA device, got {:?}", t.device()),
    }
}

/// The device address of a contiguous CUDA tensor; it stays valid while `t` lives.
pub(crate) fn tensor_ptr(t: &Tensor) -> Result<u64> {
    with_storage(t, dptr)
}

/// The CUDA device a tensor lives on.
pub(crate) fn device_of(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        d => bail!("expected a tensor on a CUDA device, got {d:?}"),
    }
}

/// A new buffer of `n` elements of `dtype`, zeroed (for outputs a kernel accumulates into).
pub(crate) fn zeros(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    let n = n.max(1);
    let slice = match dtype {
        DType::F32 => CudaStorageSlice::F32(dev.alloc_zeros(n)?),
        DType::BF16 => CudaStorageSlice::BF16(dev.alloc_zeros(n)?),
        DType::F16 => CudaStorageSlice::F16(dev.alloc_zeros(n)?),
        DType::I32 => CudaStorageSlice::I32(dev.alloc_zeros(n)?),
        DType::F64 => CudaStorageSlice::F64(dev.alloc_zeros(n)?),
        dt => bail!("no CUDA kernel output of {dt:?}"),
    };
    Ok(CudaStorage {
        slice,
        device: dev.clone(),
    })
}

/// A new buffer of `n` elements of `dtype` whose contents are undefined: only for outputs the
/// next kernel writes in full.
pub(crate) fn output(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    let n = n.max(1);
    // SAFETY: the callers launch a kernel that writes every one of the `n` elements before the
    // buffer is read.
    let slice = unsafe {
        match dtype {
            DType::F32 => CudaStorageSlice::F32(dev.alloc(n)?),
            DType::BF16 => CudaStorageSlice::BF16(dev.alloc(n)?),
            DType::F16 => CudaStorageSlice::F16(dev.alloc(n)?),
            dt => bail!("no CUDA kernel output of {dt:?}"),
        }
    };
    Ok(CudaStorage {
        slice,
        device: dev.clone(),
    })
}

/// The address of a freshly allocated (so contiguous, offset 0) buffer.
pub(crate) fn out_ptr(s: &CudaStorage) -> Result<u64> {
    dptr(s, &Layout::contiguous(1))
}

/// Wraps a kernel's output as a tensor outside the autograd graph (the ops of this crate attach
/// their own backward).
pub(crate) fn into_tensor(s: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
}

/// (rows, cols) of a contiguous layout reduced over its last dimension.
fn rows_cols(l: &Layout) -> Result<(usize, usize)> {
    let cols = l.dims().last().copied().unwrap_or(1).max(1);
    let n = l.shape().elem_count();
    if cols > i32::MAX as usize || n / cols > i32::MAX as usize {
        candle_core::bail!("row kernel: {:?} is too large", l.dims());
    }
    Ok((n / cols, cols))
}

/// One block per row: a warp for short rows, up to 512 threads for long ones.
pub(crate) fn row_block(cols: usize) -> u32 {
    (cols.div_ceil(32) * 32).clamp(32, 512) as u32
}

pub(crate) fn row_kernel(
    name: &str,
    s: &CudaStorage,
    l: &Layout,
    inputs: &[u64],
    tail: &[Arg],
) -> Result<CudaStorage> {
    let (rows, cols) = rows_cols(l)?;
    let dt = s.dtype();
    let out = output(&s.device, dt, rows * cols)?;
    let mut args: Vec<Arg> = inputs.iter().map(|p| Arg::Ptr(*p)).collect();
    args.push(Arg::Ptr(out_ptr(&out)?));
    args.push(Arg::I32(cols as i32));
    args.extend_from_slice(tail);
    launch(
        &s.device,
        &format!("{name}_{}", suffix(dt)?),
        (rows as u32, 1),
        row_block(cols),
        &args,
    )?;
    Ok(out)
}

/// (planes, H, W) of an [N, C, H, W] tensor: the upsampling and pooling kernels work on planes.
pub(crate) fn plane_dims(dims: &[usize]) -> Result<(usize, usize, usize)> {
    match dims {
        [n, c, h, w] => Ok((n * c, *h, *w)),
        d => candle_core::bail!("expected [N, C, H, W], got {d:?}"),
    }
}
