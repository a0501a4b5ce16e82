// act(gate) * value, the gated feed-forward (T5's two projections; GEGLU's halves of one),
// forward and backward as grid-stride element kernels over rows of `width`: the operands' rows
// `in_stride` apart (T5: width, two buffers; GEGLU: 2 width, value and gate pointers into the
// same rows), the gradients' rows `out_stride` apart (T5: width, the two halves of a [2, ..]
// buffer; GEGLU: 2 width, the projection's gradient). Each value rounds as the two ops' would
// (the activation, then the product; the product's gradient, then the activation's), in T.
// `act` follows the CPU's `Activation`: 0 GELU-tanh (gelu_new), 1 GELU-erf, 2 SiLU, 3 ReLU.
// Launcher: gated.rs.

template <typename T>
__device__ __forceinline__ float round_as(float v) {
  T t[1];
  st(t, 0, v);
  return ld(t, 0);
}

__device__ __forceinline__ float gated_act(int act, float x) {
  switch (act) {
    case 0: {
      const float u = 0.7978845608028654f * x * (1.f + 0.044715f * x * x);
      return 0.5f * x * (1.f + tanhf(u));
    }
    case 1: return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));
    case 2: return x / (1.f + expf(-x));
    default: return x > 0.f ? x : 0.f;
  }
}

// g * act'(x); ReLU's is g where x > 0 and 0 elsewhere, whatever g is (PyTorch's).
__device__ __forceinline__ float gated_grad(int act, float g, float x) {
  switch (act) {
    case 0: {
      const float x2 = x * x;
      const float t = tanhf(0.7978845608028654f * x * (1.f + 0.044715f * x2));
      const float du = 0.7978845608028654f * (1.f + 3.f * 0.044715f * x2);
      return g * (0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du);
    }
    case 1: {
      const float cdf = 0.5f * (1.f + erff(x * 0.7071067811865476f));
      const float pdf = 0.3989422804014327f * expf(-0.5f * x * x);
      return g * (cdf + x * pdf);
    }
    case 2: {
      const float s = 1.f / (1.f + expf(-x));
      return g * (s * (1.f + x * (1.f - s)));
    }
    default: return x > 0.f ? g : 0.f;
  }
}

template <typename T>
__device__ void gated_forward(const T* gate, const T* value, T* y, long long n, long long width,
                              long long in_stride, int act) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / width, at = r * in_stride + (i - r * width);
    st(y, i, __fmul_rn(round_as<T>(gated_act(act, ld(gate, at))), ld(value, at)));
  }
}

template <typename T>
__device__ void gated_backward(const T* g, const T* gate, const T* value, T* d_gate, T* d_value,
                               long long n, long long width, long long in_stride,
                               long long out_stride, int act) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / width, j = i - r * width;
    const long long at = r * in_stride + j, out = r * out_stride + j;
    const float gi = ld(g, i), a = ld(gate, at);
    st(d_value, out, __fmul_rn(gi, round_as<T>(gated_act(act, a))));
    st(d_gate, out, gated_grad(act, round_as<T>(__fmul_rn(gi, ld(value, at))), a));
  }
}

#define GATED(T, S)                                                                          \
  extern "C" __global__ void gated_fwd_##S(const T* gate, const T* value, T* y, long long n, \
                                           long long width, long long in_stride, int act) {  \
    gated_forward(gate, value, y, n, width, in_stride, act);                                 \
  }                                                                                          \
  extern "C" __global__ void gated_bwd_##S(const T* g, const T* gate, const T* value,        \
                                           T* d_gate, T* d_value, long long n,               \
                                           long long width, long long in_stride,             \
                                           long long out_stride, int act) {                  \
    gated_backward(g, gate, value, d_gate, d_value, n, width, in_stride, out_stride, act);   \
  }
FT_FOR_DTYPES(GATED)
