//! gemm's per-thread scratch, made on purpose. gemm (under candle's CPU matmul and this crate's
//! convolution) packs the left operand of a product into a thread-local slab the size of the
//! L2 cache, made the first time the thread takes that path and kept for the thread's life.
//! Which products take it depends on the kernel gemm picks at run time (AVX2 or AVX-512: the
//! 8 x 8 product that once made it no longer does under AVX-512), so a ledger that wants the
//! slabs in its baseline makes them with a product that always takes that path.

/// Makes the calling thread's slab: one product whose left operand is column-major with a row
/// count a multiple of every kernel's lane count (8 for AVX2, 16 for AVX-512), which gemm
/// never packs ahead and so packs, panel by panel, in the slab.
pub fn warm_this_thread() {
    const M: usize = 256;
    const N: usize = 16;
    const K: usize = 16;
    let lhs = vec![0f32; M * K];
    let rhs = vec![0f32; K * N];
    let mut dst = vec![0f32; M * N];
    // SAFETY: `lhs` holds M x K values read column-major (row stride 1, column stride M),
    // `rhs` K x N row-major, `dst` M x N row-major; `dst` is borrowed mutably and aliases
    // neither operand.
    unsafe {
        gemm::gemm(
            M,
            N,
            K,
            dst.as_mut_ptr(),
            1,
            N as isize,
            false,
            lhs.as_ptr(),
            M as isize,
            1,
            rhs.as_ptr(),
            1,
            N as isize,
            0f32,
            1f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Makes the slab of the calling thread and of each of rayon's threads.
pub fn warm_all_threads() {
    warm_this_thread();
    rayon::broadcast(|_| warm_this_thread());
}
