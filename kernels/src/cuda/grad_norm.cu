// Sums of squares of gradients (the global norm, or each tensor's into its own slot) with one
// read-back, and the f16 loss scale's unscale with its inf/NaN check. Launcher: grad_norm.rs.

// Gradient unscale, inf/NaN check and cast to fp32 in one pass; `found` is set to 1 when any
// element is not finite.
template <typename G>
__device__ void unscale(const G* g, float* out, long long n, float inv_scale, int* found) {
  int bad = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float v = ld(g, i) * inv_scale;
    bad |= !is_finite(v);
    out[i] = v;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicExch(found, 1);
}

// atomicAdd on a double exists from sm_60; below that (an NVRTC default of compute_52) the
// same through a compare-and-swap loop, so the source compiles for any target.
__device__ __forceinline__ void atomic_add_f64(double* p, double v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 600
  unsigned long long* a = reinterpret_cast<unsigned long long*>(p);
  unsigned long long old = *a, seen;
  do {
    seen = old;
    old = atomicCAS(a, seen, __double_as_longlong(__longlong_as_double(seen) + v));
  } while (seen != old);
#else
  atomicAdd(p, v);
#endif
}

// Sum of squares for the global gradient norm: f32 per thread and block, then one double atomic
// per block into `acc`, so all of a model's gradients need a single read-back.
template <typename G>
__device__ void sum_squares(const G* g, long long n, double* acc) {
  float s = 0.f;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float v = ld(g, i);
    s += v * v;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) atomic_add_f64(acc, (double)s);
}

#define GRAD_NORM(T, S)                                                                         \
  extern "C" __global__ void sum_squares_##S(const T* g, long long n, double* acc) {            \
    sum_squares(g, n, acc);                                                                     \
  }                                                                                             \
  extern "C" __global__ void unscale_##S(const T* g, float* out, long long n, float inv,        \
                                         int* found) {                                          \
    unscale(g, out, n, inv, found);                                                             \
  }
FT_FOR_DTYPES(GRAD_NORM)
