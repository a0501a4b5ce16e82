// Softmax and log-softmax over rows, forward and backward: one block per row.
// Launcher: softmax.rs.

template <typename T>
__device__ void softmax_fwd(const T* x, T* y, int cols, int log_) {
  const long long base = (long long)blockIdx.x * cols;
  float m = -FT_INF;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, ld(x, base + c));
  m = block_max(m);
  float s = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) s += __expf(ld(x, base + c) - m);
  s = block_sum(s);
  if (log_) {
    const float lse = m + __logf(s);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) st(y, base + c, ld(x, base + c) - lse);
  } else {
    const float inv = 1.f / s;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
      st(y, base + c, __expf(ld(x, base + c) - m) * inv);
  }
}

// dx = y * (g - sum(g * y)); log-softmax: dx = g - exp(y) * sum(g).
template <typename T>
__device__ void softmax_bwd(const T* y, const T* g, T* dx, int cols, int log_) {
  const long long base = (long long)blockIdx.x * cols;
  float s = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    s += log_ ? ld(g, base + c) : ld(g, base + c) * ld(y, base + c);
  s = block_sum(s);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float yv = ld(y, base + c), gv = ld(g, base + c);
    st(dx, base + c, log_ ? gv - __expf(yv) * s : yv * (gv - s));
  }
}

#define SOFTMAX(T, S)                                                                           \
  extern "C" __global__ void softmax_fwd_##S(const T* x, T* y, int cols, int log_) {            \
    softmax_fwd(x, y, cols, log_);                                                              \
  }                                                                                             \
  extern "C" __global__ void softmax_bwd_##S(const T* y, const T* g, T* dx, int cols, int l) {  \
    softmax_bwd(y, g, dx, cols, l);                                                             \
  }
FT_FOR_DTYPES(SOFTMAX)
