// Layer and RMS normalisation over rows (group norm is a layer norm over reshaped rows),
// forward and backward: one block per row. Launcher: norm.rs.

template <typename T>
__device__ void row_stats(const T* x, long long base, int cols, float eps, int center,
                          float* mean_out, float* r_out) {
  float mean = 0.f;
  if (center) {
    float s = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += ld(x, base + c);
    mean = block_sum(s) / cols;
  }
  float q = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = ld(x, base + c) - mean;
    q += d * d;
  }
  const float var = block_sum(q) / cols;
  *mean_out = mean;
  *r_out = rsqrtf(var + eps);
}

template <typename T>
__device__ void norm_fwd(const T* x, T* y, int cols, float eps, int center) {
  const long long base = (long long)blockIdx.x * cols;
  float mean, r;
  row_stats(x, base, cols, eps, center, &mean, &r);
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    st(y, base + c, (ld(x, base + c) - mean) * r);
}

// dx = r * (g - mean(g) - xhat * mean(g * xhat)), without mean(g) for RMS norm.
template <typename T>
__device__ void norm_bwd(const T* x, const T* g, T* dx, int cols, float eps, int center) {
  const long long base = (long long)blockIdx.x * cols;
  float mean, r;
  row_stats(x, base, cols, eps, center, &mean, &r);
  float sg = 0.f, sgx = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float gv = ld(g, base + c);
    sg += gv;
    sgx += gv * (ld(x, base + c) - mean) * r;
  }
  sg = center ? block_sum(sg) / cols : 0.f;
  sgx = block_sum(sgx) / cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (ld(x, base + c) - mean) * r;
    st(dx, base + c, r * (ld(g, base + c) - sg - xhat * sgx));
  }
}

#define NORM(T, S)                                                                              \
  extern "C" __global__ void norm_fwd_##S(const T* x, T* y, int cols, float eps, int c) {       \
    norm_fwd(x, y, cols, eps, c);                                                               \
  }                                                                                             \
  extern "C" __global__ void norm_bwd_##S(const T* x, const T* g, T* dx, int cols, float eps,   \
                                          int c) {                                              \
    norm_bwd(x, g, dx, cols, eps, c);                                                           \
  }
FT_FOR_DTYPES(NORM)
