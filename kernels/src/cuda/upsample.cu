// Nearest 2x upsampling of [N*C, H, W] planes, forward and backward (each input pixel sums
// its 2x2 block of the gradient): grid-stride loops. Launcher: upsample.rs.

template <typename T>
__device__ void upsample2x_fwd(const T* x, T* y, long long planes, int h, int w) {
  const long long n = planes * 4 * h * w;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long p = i / (4LL * h * w);
    const int r = (int)(i % (4LL * h * w)), oy = r / (2 * w), ox = r % (2 * w);
    st(y, i, ld(x, (p * h + oy / 2) * w + ox / 2));
  }
}

template <typename T>
__device__ void upsample2x_bwd(const T* g, T* dx, long long planes, int h, int w) {
  const long long n = planes * h * w;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long p = i / ((long long)h * w);
    const int r = (int)(i % ((long long)h * w)), y = r / w, x = r % w;
    const long long o = (p * 2 * h + 2 * y) * 2 * w + 2 * x;
    st(dx, i, ld(g, o) + ld(g, o + 1) + ld(g, o + 2 * w) + ld(g, o + 2 * w + 1));
  }
}

#define UPSAMPLE(T, S)                                                                          \
  extern "C" __global__ void upsample2x_fwd_##S(const T* x, T* y, long long p, int h, int w) {  \
    upsample2x_fwd(x, y, p, h, w);                                                              \
  }                                                                                             \
  extern "C" __global__ void upsample2x_bwd_##S(const T* g, T* dx, long long p, int h, int w) { \
    upsample2x_bwd(g, dx, p, h, w);                                                             \
  }
FT_FOR_DTYPES(UPSAMPLE)
