// AdamW on fp32 masters (or in place on bf16/f16 weights) writing the model weight in the same
// pass, with fp32 or blockwise 8-bit moments. Launcher: adamw.rs.

// One AdamW step's scalars, each rounded to f32 on the host from its f64 value as the host
// update rounds them: `decay` = 1 - lr * wd (0 without weight decay), `c1`, `c2` = 1 - b1,
// 1 - b2 (1 - 0.999f in float is off by 1.3e-5), `inv_bc2` = 1 / sqrt(1 - b2^t); `grad_mul`
// unscales the gradient (1 / loss scale, or a clipping factor).
struct AdamWArgs {
  float decay, b1, b2, c1, c2, eps, step_size, inv_bc2, grad_mul;
};

// torch.optim.AdamW's update of one element, operation for operation as the host update
// (trainer/src/optim/host_adamw.rs `element`), so that a GPU step gives the host's bits: returns the
// new weight; `m`, `v` are updated (their incoming values are ignored on the first step).
// Shared by the fp32 and 8-bit kernels.
__device__ __forceinline__ float adamw_element(float w, float g, float& m, float& v, int first,
                                               const AdamWArgs& a) {
  if (a.grad_mul != 1.f) g = affine0(g, a.grad_mul);
  const float gm = affine0(g, a.c1), gv = affine0(__fmul_rn(g, g), a.c2);
  m = first ? gm : __fadd_rn(affine0(m, a.b1), gm);
  v = first ? gv : __fadd_rn(affine0(v, a.b2), gv);
  const float denom = __fadd_rn(affine0(__fsqrt_rn(v), a.inv_bc2), a.eps);
  const float decayed = a.decay != 0.f ? affine0(w, a.decay) : w;
  return __fsub_rn(decayed, affine0(__fdiv_rn(m, denom), a.step_size));
}

// AdamW on fp32 masters, moments updated in place, and the model's low-precision weight written
// in the same pass (round to nearest, or stochastic when seed != 0). Without masters (a null
// `master`: bf16 weights trained in place, `--full-bf16`) the weight is read from `model`.
template <typename G, typename P>
__device__ void adamw(float* master, float* m, float* v, const G* grad, P* model, long long n,
                      const AdamWArgs& a, int first, unsigned long long seed) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    float mi = m[i], vi = v[i];
    const float w = master ? master[i] : ld(model, i);
    const float p = adamw_element(w, ld(grad, i), mi, vi, first, a);
    m[i] = mi;
    v[i] = vi;
    if (master) master[i] = p;
    if (model) st_model(model, i, p, seed);
  }
}

// The index of the value of the ascending 256-entry `map` nearest `x`, the lower one on a tie:
// trainer/src/optim/adamw8bit/quant.rs `nearest` (a lower-bound search, then the closer neighbour).
__device__ __forceinline__ unsigned char nearest_code(const float* map, float x) {
  int lo = 0, hi = 256;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (map[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  const int h = lo < 255 ? lo : 255, l = h > 0 ? h - 1 : 0;
  return (unsigned char)(fabsf(x - map[l]) <= fabsf(map[h] - x) ? l : h);
}

// One value quantized against its block's maximum; NaN, or an all-zero block, is stored as 0,
// an inf (its ratio clamped to [-1, 1]) as the map's extreme.
__device__ __forceinline__ unsigned char quantize_code(const float* map, float x, float max) {
  return nearest_code(map, (is_nan(x) || max == 0.f) ? 0.f : fminf(fmaxf(x / max, -1.f), 1.f));
}

// AdamW with blockwise 8-bit moments, as trainer/src/optim/adamw8bit computes it on the host: one
// CUDA block of 256 threads per quantization block of 256 values. Each thread dequantizes its
// moments (map value times the block's fp32 maximum), takes adamw_element's update, and the new
// moments are quantized against the block's new absolute maximum over the finite values (an inf
// is stored as an extreme, a NaN as 0, so one bad gradient does not poison its block). `maps`:
// the signed map of the first moment, then the unsigned map of the second (512 floats). The old
// maxima are overwritten only after block_max's barriers, so every thread has read them.
template <typename G, typename P>
__device__ void adamw8bit(float* master, unsigned char* mq, unsigned char* vq, float* m_max,
                          float* v_max, const G* grad, P* model, const float* maps, long long n,
                          const AdamWArgs& a, int first, unsigned long long seed) {
  __shared__ float smap[256], umap[256];
  const int t = threadIdx.x;
  const long long b = blockIdx.x, i = b * 256 + t;
  smap[t] = maps[t];
  umap[t] = maps[256 + t];
  __syncthreads();
  const bool in = i < n;
  float m = 0.f, v = 0.f;
  if (in) {
    if (!first) {
      m = __fmul_rn(smap[mq[i]], m_max[b]);
      v = __fmul_rn(umap[vq[i]], v_max[b]);
    }
    const float w = master ? master[i] : ld(model, i);
    const float p = adamw_element(w, ld(grad, i), m, v, first, a);
    if (master) master[i] = p;
    if (model) st_model(model, i, p, seed);
  }
  const float mm = block_max(in && is_finite(m) ? fabsf(m) : 0.f);
  const float vm = block_max(in && is_finite(v) ? fabsf(v) : 0.f);
  if (t == 0) {
    m_max[b] = mm;
    v_max[b] = vm;
  }
  if (in) {
    mq[i] = quantize_code(smap, m, mm);
    vq[i] = quantize_code(umap, v, vm);
  }
}

#define ADAMW(G, SG, P, SP)                                                                     \
  extern "C" __global__ void adamw_##SG##_##SP(float* master, float* m, float* v, const G* g,   \
                                               P* model, long long n, float decay, float b1,    \
                                               float b2, float c1, float c2, float eps,         \
                                               float step_size, float inv_bc2, float grad_mul,  \
                                               int first, unsigned long long seed) {            \
    const AdamWArgs a = {decay, b1, b2, c1, c2, eps, step_size, inv_bc2, grad_mul};             \
    adamw(master, m, v, g, model, n, a, first, seed);                                           \
  }                                                                                             \
  extern "C" __global__ void adamw8bit_##SG##_##SP(                                             \
      float* master, unsigned char* mq, unsigned char* vq, float* m_max, float* v_max,          \
      const G* g, P* model, const float* maps, long long n, float decay, float b1, float b2,    \
      float c1, float c2, float eps, float step_size, float inv_bc2, float grad_mul, int first, \
      unsigned long long seed) {                                                                \
    const AdamWArgs a = {decay, b1, b2, c1, c2, eps, step_size, inv_bc2, grad_mul};             \
    adamw8bit(master, mq, vq, m_max, v_max, g, model, maps, n, a, first, seed);                 \
  }
ADAMW(float, f32, float, f32)
ADAMW(bf16, bf16, float, f32)
ADAMW(f16, f16, float, f32)
ADAMW(float, f32, bf16, bf16)
ADAMW(bf16, bf16, bf16, bf16)
ADAMW(f16, f16, bf16, bf16)
ADAMW(float, f32, f16, f16)
ADAMW(bf16, bf16, f16, f16)
ADAMW(f16, f16, f16, f16)
