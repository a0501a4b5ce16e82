// Inverted dropout with the keep bits drawn from a counter-based hash (rand_u64 of prelude.cuh)
// of the element's stream position, so backward draws the mask again instead of keeping it.
// `scale` is 1 / (1 - p) already rounded to T; the product rounds as candle's multiply in T.
// Launcher: dropout.rs.

template <typename T>
__device__ void dropout_apply(const T* x, T* y, long long n, unsigned long long seed,
                              unsigned long long skip, unsigned long long threshold, float scale) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const bool keep = (rand_u64(seed, skip + (unsigned long long)i) >> 11) < threshold;
    st(y, i, __fmul_rn(ld(x, i), keep ? scale : 0.f));
  }
}

#define DROPOUT(T, S)                                                                       \
  extern "C" __global__ void dropout_##S(const T* x, T* y, long long n,                     \
                                         unsigned long long seed, unsigned long long skip,  \
                                         unsigned long long threshold, float scale) {       \
    dropout_apply(x, y, n, seed, skip, threshold, scale);                                   \
  }
FT_FOR_DTYPES(DROPOUT)
