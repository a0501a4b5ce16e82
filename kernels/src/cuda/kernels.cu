// The project's own CUDA kernels, compiled at run time with NVRTC (kernels/src/cuda/mod.rs).
// Self-contained: no CUDA headers, so the binaries need no toolkit on the user's machine. The
// same file also compiles as C++ on the host under kernels/tests/emulated/emu.h, which runs each
// block's threads as OS threads, so CI checks the kernels' logic without a GPU.
// Every kernel computes in f32 and reads/writes f32, bf16 or f16 through ld/st.
// Row kernels take one block per row; element kernels a grid-stride loop.

#define FT_INF __int_as_float(0x7f800000)
__device__ __forceinline__ bool is_nan(float v) { return v != v; }
__device__ __forceinline__ bool is_finite(float v) { return fabsf(v) < FT_INF; }

struct bf16 { unsigned short x; };
struct f16 { unsigned short x; };

__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16* p, long long i) {
  return __uint_as_float(((unsigned)p[i].x) << 16);
}
#ifndef FT_HOST_EMULATION
// The host emulation (kernels/tests/emulated) brings its own software conversions.
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float v) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
#endif
__device__ __forceinline__ float ld(const f16* p, long long i) { return f16_to_f32(p[i].x); }
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ unsigned short bf16_bits(float v) {
  unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);                       // round to nearest even
  return (unsigned short)(u >> 16);
}
__device__ __forceinline__ void st(bf16* p, long long i, float v) { p[i].x = bf16_bits(v); }
__device__ __forceinline__ void st(f16* p, long long i, float v) { p[i].x = f32_to_f16(v); }

// Counter-based hash (splitmix64 finaliser): the same (seed, index) always gives the same bits.
__device__ __forceinline__ unsigned rand_bits(unsigned long long seed, unsigned long long i) {
  unsigned long long z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (unsigned)((z ^ (z >> 31)) >> 32);
}

// fp32 -> bf16 with stochastic rounding: add 16 random bits below bf16's last place, truncate.
// E[result] = v, so many small updates to a bf16 weight are not all lost to rounding.
__device__ __forceinline__ unsigned short bf16_bits_stochastic(float v, unsigned r) {
  unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) >= 0x7f800000u) return bf16_bits(v);  // inf/NaN: no noise
  u += (r & 0xffffu);
  return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum/max (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
  __shared__ float sh[32];
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  v = (threadIdx.x < nw) ? sh[threadIdx.x] : 0.f;
  if (w == 0) v = warp_sum(v);
  if (threadIdx.x == 0) sh[0] = v;
  __syncthreads();
  return sh[0];
}
__device__ float block_max(float v) {
  __shared__ float sh[32];
  v = warp_max(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  v = (threadIdx.x < nw) ? sh[threadIdx.x] : -FT_INF;
  if (w == 0) v = warp_max(v);
  if (threadIdx.x == 0) sh[0] = v;
  __syncthreads();
  return sh[0];
}

// ---- softmax over rows -------------------------------------------------------------------

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

// ---- layer / RMS normalisation over rows (group norm is a layer norm over reshaped rows) ---

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

// ---- nearest 2x upsampling and pooling over [N*C, H, W] planes ----------------------------

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

// kind 0: max (first maximum wins, NaN propagates, as PyTorch), 1: average. Floor mode.
template <typename T>
__device__ void pool_fwd(const T* x, T* y, long long planes, int h, int w, int kh, int kw,
                         int sh, int sw, int kind) {
  const int oh = (h - kh) / sh + 1, ow = (w - kw) / sw + 1;
  const long long n = planes * oh * ow;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long p = i / ((long long)oh * ow);
    const int r = (int)(i % ((long long)oh * ow)), oy = r / ow, ox = r % ow;
    float best = -FT_INF, sum = 0.f;
    for (int dy = 0; dy < kh; dy++)
      for (int dxx = 0; dxx < kw; dxx++) {
        const float v = ld(x, (p * h + oy * sh + dy) * w + ox * sw + dxx);
        sum += v;
        if (v > best || (is_nan(v) && !is_nan(best))) best = v;
      }
    st(y, i, kind == 0 ? best : sum / (kh * kw));
  }
}

// One thread per input element gathers from every window that covers it: no atomics.
template <typename T>
__device__ void pool_bwd(const T* x, const T* g, T* dx, long long planes, int h, int w, int kh,
                         int kw, int sh, int sw, int kind) {
  const int oh = (h - kh) / sh + 1, ow = (w - kw) / sw + 1;
  const long long n = planes * h * w;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long p = i / ((long long)h * w);
    const int r = (int)(i % ((long long)h * w)), iy = r / w, ix = r % w;
    float acc = 0.f;
    const int oy0 = iy < kh ? 0 : (iy - kh) / sh + 1, oy1 = min(iy / sh, oh - 1);
    const int ox0 = ix < kw ? 0 : (ix - kw) / sw + 1, ox1 = min(ix / sw, ow - 1);
    for (int oy = oy0; oy <= oy1; oy++)
      for (int ox = ox0; ox <= ox1; ox++) {
        if (iy - oy * sh >= kh || ix - ox * sw >= kw) continue;
        const float go = ld(g, (p * oh + oy) * ow + ox);
        if (kind == 1) {
          acc += go / (kh * kw);
        } else {
          // Is this element the window's first maximum?
          float best = -FT_INF;
          int at = -1;
          for (int dy = 0; dy < kh; dy++)
            for (int dxx = 0; dxx < kw; dxx++) {
              const int yy = oy * sh + dy, xx = ox * sw + dxx;
              const float v = ld(x, (p * h + yy) * w + xx);
              if (at < 0 || v > best || (is_nan(v) && !is_nan(best))) {
                best = v;
                at = yy * w + xx;
              }
            }
          if (at == r) acc += go;
        }
      }
    st(dx, i, acc);
  }
}

// ---- fused casts and the optimizer step ----------------------------------------------------

// The model weight written by the optimizer: round to nearest, or stochastically for bf16 when
// seed != 0.
__device__ __forceinline__ void st_model(float* p, long long i, float v, unsigned long long) {
  p[i] = v;
}
__device__ __forceinline__ void st_model(f16* p, long long i, float v, unsigned long long) {
  st(p, i, v);
}
__device__ __forceinline__ void st_model(bf16* p, long long i, float v, unsigned long long seed) {
  p[i].x = seed ? bf16_bits_stochastic(v, rand_bits(seed, i)) : bf16_bits(v);
}

// One AdamW step's scalars, each rounded to f32 on the host from its f64 value as the host
// update rounds them: `decay` = 1 - lr * wd (0 without weight decay), `c1`, `c2` = 1 - b1,
// 1 - b2 (1 - 0.999f in float is off by 1.3e-5), `inv_bc2` = 1 / sqrt(1 - b2^t); `grad_mul`
// unscales the gradient (1 / loss scale, or a clipping factor).
struct AdamWArgs {
  float decay, b1, b2, c1, c2, eps, step_size, inv_bc2, grad_mul;
};

// `x * a + 0` as candle's `affine` computes it, with rounded intrinsics: the compiler may not
// contract them into an FMA, which would round differently from the host.
__device__ __forceinline__ float affine0(float x, float a) {
  return __fadd_rn(__fmul_rn(x, a), 0.f);
}

// torch.optim.AdamW's update of one element, operation for operation as the host update
// (memory/src/host_adamw.rs `element`), so that a GPU step gives the host's bits: returns the
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
// memory/src/adamw8bit.rs `nearest` (a lower-bound search, then the closer neighbour).
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

// AdamW with blockwise 8-bit moments, as memory/src/adamw8bit.rs computes it on the host: one
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

// ---- Adafactor ------------------------------------------------------------------------------
//
// transformers' Adafactor update as memory/src/adafactor.rs computes it on the host, for the
// settings HF Trainer and kohya use (no first moment, no parameter scale). A tensor of two or
// more dims is viewed as [B, R, C] (its last two dims R x C) and its second moment kept as
// row[B R] and col[B C]; a smaller one keeps a full v[n] (in `row`, with `col` null). Per
// tensor: the row and column means of g^2 + eps1 (warp per row; column sums over chunks of
// rows, then in order over the chunks), the mean of each row block, the update's sum of squares
// (per-block partials), then the weight update. Every reduction has a fixed order, so a step is
// deterministic. The per-element arithmetic is the host's, op for op, with rounded intrinsics
// (`mean` is a sum times 1/count, as candle's mean; `x / s` for a scalar is `x * (1/s)`).
struct AdafactorArgs {
  // The gradient factor (1 / loss scale, a clip factor, or 1); eps1; beta2t and 1 - beta2t.
  float grad_mul, eps1, b2, c2;
  // 1/R, 1/C (the means over rows and columns).
  float inv_r, inv_c;
  // The step size; lr * -weight_decay (0: none); 1/sqrt(n); 1/clip_threshold.
  float lr, wdl, inv_sqrt_n, inv_clip;
};

template <typename G>
__device__ __forceinline__ float adafactor_grad(const G* g, long long i, const AdafactorArgs& a) {
  const float v = ld(g, i);
  return a.grad_mul != 1.f ? affine0(v, a.grad_mul) : v;
}
__device__ __forceinline__ float adafactor_sq(float g, const AdafactorArgs& a) {
  return __fadd_rn(__fmul_rn(g, g), a.eps1);
}
// beta2t x + (1 - beta2t) fresh, where fresh is the mean `sum * inv`.
__device__ __forceinline__ float adafactor_decay(float x, float sum, float inv,
                                                 const AdafactorArgs& a) {
  return __fadd_rn(affine0(x, a.b2), affine0(affine0(sum, inv), a.c2));
}
// The unclipped update of element i from the new second moment: g / sqrt(row / mean(row) x col)
// as the host forms it, 1/sqrt(row / rmean) times 1/sqrt(col) times g; or 1/sqrt(v) times g.
__device__ __forceinline__ float adafactor_u(float g, long long i, const float* row,
                                             const float* rmean, const float* col, int R, int C) {
  if (!col) return __fmul_rn(__fdiv_rn(1.f, __fsqrt_rn(row[i])), g);
  const long long rc = (long long)R * C, b = i / rc, rem = i - b * rc;  // two divisions, not four
  const long long r = rem / C, c = rem - r * C;
  const float rf = __fdiv_rn(1.f, __fsqrt_rn(__fdiv_rn(row[b * R + r], rmean[b])));
  const float cf = __fdiv_rn(1.f, __fsqrt_rn(col[b * C + c]));
  return __fmul_rn(__fmul_rn(rf, cf), g);
}

// The sum over `cols` consecutive values f(i) of row j, by one warp per row, or with
// `per_thread` (rows shorter than a warp: a 3x3 kernel's) by one thread per row, so that 29 of
// 32 lanes do not idle. Returns false to the threads past the last row (a whole warp's, in the
// warp mode); lane 0 (every thread, per thread) holds the sum.
template <typename F>
__device__ __forceinline__ bool row_sum(long long rows, int cols, int per_thread, F f,
                                        long long& j, float& s) {
  const long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  j = per_thread ? t : t >> 5;
  if (j >= rows) return false;
  const int lane = per_thread ? 0 : (int)(threadIdx.x & 31), step = per_thread ? 1 : 32;
  s = 0.f;
  for (int c = lane; c < cols; c += step) s += f(j * cols + c);
  if (!per_thread) s = warp_sum(s);
  return lane == 0;
}

// row[j] <- decay(row[j], mean_c(g^2 + eps1)) for each row of `cols` values.
template <typename G>
__device__ void adafactor_rows(const G* g, float* row, long long rows, int cols, int per_thread,
                               const AdafactorArgs& a) {
  long long j;
  float s;
  auto sq = [&](long long i) { return adafactor_sq(adafactor_grad(g, i, a), a); };
  if (row_sum(rows, cols, per_thread, sq, j, s)) row[j] = adafactor_decay(row[j], s, a.inv_c, a);
}

// Column sums of g^2 + eps1 over chunk s of `chunk` rows, one thread per (chunk, b, c):
// part[s][b C + c]; with one chunk (part null) the column's decay is applied at once.
template <typename G>
__device__ void adafactor_col_parts(const G* g, float* col, float* part, long long bc, int R,
                                    int C, int chunk, int chunks, const AdafactorArgs& a) {
  for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < bc * chunks;
       k += (long long)gridDim.x * blockDim.x) {
    const long long q = k % bc, b = q / C;
    const int c = (int)(q % C), s = (int)(k / bc);
    const int r1 = min(R, (s + 1) * chunk);
    float sum = 0.f;
    for (int r = s * chunk; r < r1; r++)
      sum += adafactor_sq(adafactor_grad(g, (b * R + r) * C + c, a), a);
    if (part) part[k] = sum;
    else col[q] = adafactor_decay(col[q], sum, a.inv_r, a);
  }
}

// col[q] <- decay(col[q], (sum over chunks of part[s][q]) / R), the chunks in order.
__device__ void adafactor_cols_impl(const float* part, float* col, long long bc, int chunks,
                               const AdafactorArgs& a) {
  for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < bc;
       q += (long long)gridDim.x * blockDim.x) {
    float sum = 0.f;
    for (int s = 0; s < chunks; s++) sum += part[s * bc + q];
    col[q] = adafactor_decay(col[q], sum, a.inv_r, a);
  }
}

// rmean[b] = mean of row[b R .. b R + R), per warp or per thread as row_sum.
__device__ void adafactor_row_mean_impl(const float* row, float* rmean, long long blocks, int R,
                                        int per_thread, float inv_r) {
  long long b;
  float s;
  auto at = [&](long long i) { return row[i]; };
  if (row_sum(blocks, R, per_thread, at, b, s)) rmean[b] = affine0(s, inv_r);
}

// The update's sum of squares, one partial per block into part[blockIdx.x]; a full second
// moment (col null) is decayed here first, in place.
template <typename G>
__device__ void adafactor_sumsq(const G* g, float* row, const float* rmean, const float* col,
                                float* part, long long n, int R, int C, const AdafactorArgs& a) {
  float s = 0.f;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float gi = adafactor_grad(g, i, a);
    if (!col) row[i] = adafactor_decay(row[i], adafactor_sq(gi, a), 1.f, a);
    const float u = adafactor_u(gi, i, row, rmean, col, R, C);
    s += __fmul_rn(u, u);
  }
  s = block_sum(s);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// The weight update: every block adds the `parts` partials in the same order, takes
// denom = max(rms(u) / clip, 1) as candle's CPU `maximum` does (a NaN stays; the fmaxf of its
// CUDA op would drop it), then
// w <- (w + w lr (-wd)) - (u / denom) lr, into the master and/or the model weight (rounded
// stochastically when seed != 0). Without a master the weight is read from `model`.
template <typename G, typename P>
__device__ void adafactor_apply(float* master, const G* g, P* model, const float* row,
                                const float* rmean, const float* col, const float* part,
                                int parts, long long n, int R, int C, const AdafactorArgs& a,
                                unsigned long long seed) {
  float s = 0.f;
  for (int k = threadIdx.x; k < parts; k += blockDim.x) s += part[k];
  s = block_sum(s);
  const float ratio = affine0(affine0(__fsqrt_rn(s), a.inv_sqrt_n), a.inv_clip);
  const float denom = ratio < 1.f ? 1.f : ratio;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    float w = master ? master[i] : ld(model, i);
    if (a.wdl != 0.f) w = __fadd_rn(w, __fmul_rn(w, a.wdl));
    const float u = adafactor_u(adafactor_grad(g, i, a), i, row, rmean, col, R, C);
    const float p = __fsub_rn(w, __fmul_rn(__fdiv_rn(u, denom), a.lr));
    if (master) master[i] = p;
    if (model) st_model(model, i, p, seed);
  }
}

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

__device__ void round_stochastic(const float* x, bf16* y, long long n, unsigned long long seed) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    y[i].x = bf16_bits_stochastic(x[i], rand_bits(seed, i));
}

// ---- memory-efficient attention (head dim D, one thread per query or key row) -------------
//
// q [BH, Lq, D]; k, v rows of `kvs` elements (K and V packed side by side: kvs = 2 D); bias
// (optional, f32) indexed by broadcast strides over [B, H, Lq, Lk] (sb, sh, sq, sk; 0 where it
// broadcasts). Forward: online softmax over key tiles held in shared memory; saves
// lse = m + log(sum) per row. Never forms the Lq x Lk matrix. Tiles are read as float4
// broadcasts (every thread of a warp reads the same row), a quarter of the shared-memory loads.

#define TILE 64

// Dot product of a register row with a shared-memory row.
template <int D>
__device__ __forceinline__ float dot_row(const float* r, const float* sm) {
  float s = 0.f;
#pragma unroll
  for (int d = 0; d < D; d += 4) {
    const float4 t = *reinterpret_cast<const float4*>(sm + d);
    s += r[d] * t.x + r[d + 1] * t.y + r[d + 2] * t.z + r[d + 3] * t.w;
  }
  return s;
}

// acc += a * sm (a register row and a shared-memory row).
template <int D>
__device__ __forceinline__ void axpy_row(float* acc, float a, const float* sm) {
#pragma unroll
  for (int d = 0; d < D; d += 4) {
    const float4 t = *reinterpret_cast<const float4*>(sm + d);
    acc[d] += a * t.x;
    acc[d + 1] += a * t.y;
    acc[d + 2] += a * t.z;
    acc[d + 3] += a * t.w;
  }
}

// Loads rows [r0, r0 + n) of a [rows, stride]-strided tensor (D used columns) into `sm`,
// multiplied by `mul`.
template <int D, typename T>
__device__ __forceinline__ void load_tile(float (*sm)[D], const T* src, long long r0, int n,
                                          int stride, float mul) {
  for (int e = threadIdx.x; e < n * D; e += blockDim.x) {
    const int j = e / D, d = e % D;
    sm[j][d] = ld(src, (r0 + j) * stride + d) * mul;
  }
}

template <int D, typename T>
__device__ void attn_fwd(const T* q, const T* k, const T* v, const float* bias, T* o, float* lse,
                         int heads, int lq, int lk, int kvs, float scale, long long sb,
                         long long sh, long long sq, long long sk) {
  __shared__ __align__(16) float ks[TILE][D];
  __shared__ __align__(16) float vs[TILE][D];
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  const bool live = row < lq;
  float qr[D], acc[D];
  const long long qbase = ((long long)bh * lq + (live ? row : 0)) * D;
  for (int d = 0; d < D; d++) {
    qr[d] = live ? ld(q, qbase + d) * scale : 0.f;
    acc[d] = 0.f;
  }
  const float* brow = bias ? bias + b * sb + h * sh + (long long)(live ? row : 0) * sq : nullptr;
  float m = -FT_INF, l = 0.f;
  for (int t0 = 0; t0 < lk; t0 += TILE) {
    const int n = min(TILE, lk - t0);
    __syncthreads();
    load_tile<D>(ks, k, (long long)bh * lk + t0, n, kvs, 1.f);
    load_tile<D>(vs, v, (long long)bh * lk + t0, n, kvs, 1.f);
    __syncthreads();
    if (!live) continue;
    for (int j = 0; j < n; j++) {
      float s = dot_row<D>(qr, ks[j]);
      if (brow) s += brow[(t0 + j) * sk];
      if (s == -FT_INF) continue;
      // Rescale the running sums only when the maximum moves (rare after the first keys).
      if (s > m) {
        const float c = __expf(m - s);
        l *= c;
#pragma unroll
        for (int d = 0; d < D; d++) acc[d] *= c;
        m = s;
      }
      const float p = __expf(s - m);
      l += p;
      axpy_row<D>(acc, p, vs[j]);
    }
  }
  if (!live) return;
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int d = 0; d < D; d++) st(o, qbase + d, acc[d] * inv);
  lse[(long long)bh * lq + row] = l > 0.f ? m + __logf(l) : -FT_INF;
}

// delta[row] = sum_d dO[row, d] * O[row, d], the softmax backward's row term.
template <int D, typename T>
__device__ void attn_delta(const T* o, const T* go, float* delta, long long rows) {
  const long long row = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (row >= rows) return;
  float s = 0.f;
  for (int d = 0; d < D; d++) s += ld(o, row * D + d) * ld(go, row * D + d);
  delta[row] = s;
}

// The backward kernels give each row two threads, each holding half of its 64 dimensions (three
// or four 64-float rows per thread would not fit in registers: the one-thread-per-row version
// spilled up to 384 bytes per thread): dot products are two half sums joined by one shuffle.
// Blocks of 128 threads cover 64 rows. Every lane runs every shuffle (rows past the end and
// fully masked rows compute with p = 0 and store nothing), so the warp never diverges around one.

// Half of a dot product over the half-row `half` of `sm`, summed with the partner thread's.
template <int H>
__device__ __forceinline__ float dot_pair(const float* r, const float* sm, int half) {
  const float s = dot_row<H>(r, sm + half * H);
  return s + __shfl_xor_sync(0xffffffffu, s, 1);
}

// dQ (and the bias gradient, atomically added into an f32 buffer shaped like the bias):
// recomputing p = exp(s - lse) tile by tile.
template <int D, typename T>
__device__ void attn_bwd_q(const T* q, const T* k, const T* v, const float* bias, const T* go,
                           const float* lse, const float* delta, T* dq, float* dbias, int heads,
                           int lq, int lk, int kvs, float scale, long long sb, long long sh,
                           long long sq, long long sk) {
  constexpr int H = D / 2;
  __shared__ __align__(16) float ks[TILE][D];
  __shared__ __align__(16) float vs[TILE][D];
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int row = blockIdx.x * TILE + (threadIdx.x >> 1), half = threadIdx.x & 1;
  const bool live = row < lq;
  const long long base = ((long long)bh * lq + (live ? row : 0)) * D + half * H;
  float qr[H], gr[H], acc[H];
  for (int d = 0; d < H; d++) {
    qr[d] = live ? ld(q, base + d) * scale : 0.f;
    gr[d] = live ? ld(go, base + d) : 0.f;
    acc[d] = 0.f;
  }
  const long long boff = b * sb + h * sh + (long long)(live ? row : 0) * sq;
  const float L = live ? lse[(long long)bh * lq + row] : -FT_INF;
  const bool act = L != -FT_INF;  // a live row with at least one key
  const float dl = live ? delta[(long long)bh * lq + row] : 0.f;
  for (int t0 = 0; t0 < lk; t0 += TILE) {
    const int n = min(TILE, lk - t0);
    __syncthreads();
    load_tile<D>(ks, k, (long long)bh * lk + t0, n, kvs, 1.f);
    load_tile<D>(vs, v, (long long)bh * lk + t0, n, kvs, 1.f);
    __syncthreads();
    for (int j = 0; j < n; j++) {
      float s = dot_pair<H>(qr, ks[j], half);
      if (bias) s += bias[boff + (t0 + j) * sk];
      const float p = act ? __expf(s - L) : 0.f;
      const float dp = dot_pair<H>(gr, vs[j], half);  // every lane shuffles
      const float ds = act ? p * (dp - dl) : 0.f;
      if (dbias && act && half == 0) atomicAdd(dbias + boff + (t0 + j) * sk, ds);
      axpy_row<H>(acc, ds, ks[j] + half * H);
    }
  }
  if (!live) return;
  for (int d = 0; d < H; d++) st(dq, base + d, acc[d] * scale);
}

// dK, dV: query tiles (q * scale, dO, lse, delta) in shared memory.
template <int D, typename T>
__device__ void attn_bwd_kv(const T* q, const T* k, const T* v, const float* bias, const T* go,
                            const float* lse, const float* delta, T* dk, T* dv, int heads,
                            int lq, int lk, int kvs, float scale, long long sb, long long sh,
                            long long sq, long long sk) {
  constexpr int H = D / 2;
  __shared__ __align__(16) float qs[TILE][D];
  __shared__ __align__(16) float gs[TILE][D];
  __shared__ float ls[TILE], ds_[TILE];
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int col = blockIdx.x * TILE + (threadIdx.x >> 1), half = threadIdx.x & 1;
  const bool live = col < lk;
  const long long base = ((long long)bh * lk + (live ? col : 0)) * kvs + half * H;
  float kr[H], vr[H], dkr[H], dvr[H];
  for (int d = 0; d < H; d++) {
    kr[d] = live ? ld(k, base + d) : 0.f;
    vr[d] = live ? ld(v, base + d) : 0.f;
    dkr[d] = 0.f;
    dvr[d] = 0.f;
  }
  const long long boff = b * sb + h * sh + (long long)(live ? col : 0) * sk;
  for (int t0 = 0; t0 < lq; t0 += TILE) {
    const int n = min(TILE, lq - t0);
    __syncthreads();
    load_tile<D>(qs, q, (long long)bh * lq + t0, n, D, scale);
    load_tile<D>(gs, go, (long long)bh * lq + t0, n, D, 1.f);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      ls[i] = lse[(long long)bh * lq + t0 + i];
      ds_[i] = delta[(long long)bh * lq + t0 + i];
    }
    __syncthreads();
    for (int i = 0; i < n; i++) {
      if (ls[i] == -FT_INF) continue;  // the same for the whole block
      float s = dot_pair<H>(kr, qs[i], half);
      if (bias) s += bias[boff + (long long)(t0 + i) * sq];
      const float p = live ? __expf(s - ls[i]) : 0.f;
      const float ds = p * (dot_pair<H>(vr, gs[i], half) - ds_[i]);
      axpy_row<H>(dvr, p, gs[i] + half * H);
      axpy_row<H>(dkr, ds, qs[i] + half * H);
    }
  }
  if (!live) return;
  for (int d = 0; d < H; d++) {
    st(dk, base + d, dkr[d]);
    st(dv, base + d, dvr[d]);
  }
}

// ---- extern "C" entry points, one per dtype ------------------------------------------------

#define ROWS(T, S)                                                                              \
  extern "C" __global__ void softmax_fwd_##S(const T* x, T* y, int cols, int log_) {            \
    softmax_fwd(x, y, cols, log_);                                                              \
  }                                                                                             \
  extern "C" __global__ void softmax_bwd_##S(const T* y, const T* g, T* dx, int cols, int l) {  \
    softmax_bwd(y, g, dx, cols, l);                                                             \
  }                                                                                             \
  extern "C" __global__ void norm_fwd_##S(const T* x, T* y, int cols, float eps, int c) {       \
    norm_fwd(x, y, cols, eps, c);                                                               \
  }                                                                                             \
  extern "C" __global__ void norm_bwd_##S(const T* x, const T* g, T* dx, int cols, float eps,   \
                                          int c) {                                              \
    norm_bwd(x, g, dx, cols, eps, c);                                                           \
  }                                                                                             \
  extern "C" __global__ void upsample2x_fwd_##S(const T* x, T* y, long long p, int h, int w) {  \
    upsample2x_fwd(x, y, p, h, w);                                                              \
  }                                                                                             \
  extern "C" __global__ void upsample2x_bwd_##S(const T* g, T* dx, long long p, int h, int w) { \
    upsample2x_bwd(g, dx, p, h, w);                                                             \
  }                                                                                             \
  extern "C" __global__ void pool_fwd_##S(const T* x, T* y, long long p, int h, int w, int kh,  \
                                          int kw, int sh, int sw, int kind) {                   \
    pool_fwd(x, y, p, h, w, kh, kw, sh, sw, kind);                                              \
  }                                                                                             \
  extern "C" __global__ void pool_bwd_##S(const T* x, const T* g, T* dx, long long p, int h,    \
                                          int w, int kh, int kw, int sh, int sw, int kind) {    \
    pool_bwd(x, g, dx, p, h, w, kh, kw, sh, sw, kind);                                          \
  }                                                                                             \
  extern "C" __global__ void sum_squares_##S(const T* g, long long n, double* acc) {            \
    sum_squares(g, n, acc);                                                                     \
  }                                                                                             \
  extern "C" __global__ void unscale_##S(const T* g, float* out, long long n, float inv,        \
                                         int* found) {                                          \
    unscale(g, out, n, inv, found);                                                             \
  }                                                                                             \
  extern "C" __global__ void attn_fwd_##S(const T* q, const T* k, const T* v, const float* bias,\
                                          T* o, float* lse, int heads, int lq, int lk, int kvs, \
                                          float scale, long long sb, long long sh,              \
                                          long long sq, long long sk) {                         \
    attn_fwd<64>(q, k, v, bias, o, lse, heads, lq, lk, kvs, scale, sb, sh, sq, sk);                  \
  }                                                                                             \
  extern "C" __global__ void attn_delta_##S(const T* o, const T* go, float* delta,              \
                                            long long rows) {                                   \
    attn_delta<64>(o, go, delta, rows);                                                         \
  }                                                                                             \
  extern "C" __global__ void attn_bwd_q_##S(const T* q, const T* k, const T* v,                 \
                                            const float* bias, const T* go, const float* lse,   \
                                            const float* delta, T* dq, float* dbias, int heads, \
                                            int lq, int lk, int kvs, float scale, long long sb,          \
                                            long long sh, long long sq, long long sk) {         \
    attn_bwd_q<64>(q, k, v, bias, go, lse, delta, dq, dbias, heads, lq, lk, kvs, scale, sb, sh, sq,  \
                   sk);                                                                         \
  }                                                                                             \
  extern "C" __global__ void attn_bwd_kv_##S(const T* q, const T* k, const T* v,                \
                                             const float* bias, const T* go, const float* lse,  \
                                             const float* delta, T* dk, T* dv, int heads,       \
                                             int lq, int lk, int kvs, float scale, long long sb,         \
                                             long long sh, long long sq, long long sk) {        \
    attn_bwd_kv<64>(q, k, v, bias, go, lse, delta, dk, dv, heads, lq, lk, kvs, scale, sb, sh, sq,    \
                    sk);                                                                        \
  }

ROWS(float, f32)
ROWS(bf16, bf16)
ROWS(f16, f16)

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

#define ADAFACTOR_ARGS                                                                          \
  float grad_mul, float eps1, float b2, float c2, float inv_r, float inv_c, float lr, float wdl, \
      float inv_sqrt_n, float inv_clip
#define ADAFACTOR_PACK {grad_mul, eps1, b2, c2, inv_r, inv_c, lr, wdl, inv_sqrt_n, inv_clip}
#define ADAFACTOR_G(G, SG)                                                                      \
  extern "C" __global__ void adafactor_rows_##SG(const G* g, float* row, long long rows,        \
                                                 int cols, int per_thread, ADAFACTOR_ARGS) {    \
    const AdafactorArgs a = ADAFACTOR_PACK;                                                     \
    adafactor_rows(g, row, rows, cols, per_thread, a);                                          \
  }                                                                                             \
  extern "C" __global__ void adafactor_col_parts_##SG(const G* g, float* col, float* part,      \
                                                      long long bc, int R, int C, int chunk,    \
                                                      int chunks, ADAFACTOR_ARGS) {             \
    const AdafactorArgs a = ADAFACTOR_PACK;                                                     \
    adafactor_col_parts(g, col, part, bc, R, C, chunk, chunks, a);                              \
  }                                                                                             \
  extern "C" __global__ void adafactor_sumsq_##SG(const G* g, float* row, const float* rmean,   \
                                                  const float* col, float* part, long long n,   \
                                                  int R, int C, ADAFACTOR_ARGS) {               \
    const AdafactorArgs a = ADAFACTOR_PACK;                                                     \
    adafactor_sumsq(g, row, rmean, col, part, n, R, C, a);                                      \
  }
#define ADAFACTOR_APPLY(G, SG, P, SP)                                                           \
  extern "C" __global__ void adafactor_apply_##SG##_##SP(                                       \
      float* master, const G* g, P* model, const float* row, const float* rmean,                \
      const float* col, const float* part, int parts, long long n, int R, int C,                \
      ADAFACTOR_ARGS, unsigned long long seed) {                                                \
    const AdafactorArgs a = ADAFACTOR_PACK;                                                     \
    adafactor_apply(master, g, model, row, rmean, col, part, parts, n, R, C, a, seed);          \
  }
ADAFACTOR_G(float, f32)
ADAFACTOR_G(bf16, bf16)
ADAFACTOR_G(f16, f16)
ADAFACTOR_APPLY(float, f32, float, f32)
ADAFACTOR_APPLY(bf16, bf16, float, f32)
ADAFACTOR_APPLY(f16, f16, float, f32)
ADAFACTOR_APPLY(float, f32, bf16, bf16)
ADAFACTOR_APPLY(bf16, bf16, bf16, bf16)
ADAFACTOR_APPLY(f16, f16, bf16, bf16)
ADAFACTOR_APPLY(float, f32, f16, f16)
ADAFACTOR_APPLY(bf16, bf16, f16, f16)
ADAFACTOR_APPLY(f16, f16, f16, f16)

extern "C" __global__ void adafactor_cols(const float* part, float* col, long long bc,
                                          int chunks, ADAFACTOR_ARGS) {
  const AdafactorArgs a = ADAFACTOR_PACK;
  adafactor_cols_impl(part, col, bc, chunks, a);
}
extern "C" __global__ void adafactor_row_mean(const float* row, float* rmean, long long blocks,
                                              int R, int per_thread, float inv_r) {
  adafactor_row_mean_impl(row, rmean, blocks, R, per_thread, inv_r);
}

extern "C" __global__ void round_stochastic_bf16(const float* x, bf16* y, long long n,
                                                 unsigned long long seed) {
  round_stochastic(x, y, n, seed);
}

// ---- tensor-core attention (bf16, 64-dim heads, sm_80+) -----------------------------------
//
// FlashAttention-2 with mma.sync.m16n8k16 (bf16 in, f32 accumulate). A block has 4 warps and
// 64 rows (queries, or keys in the dK/dV kernel), 16 per warp; each product is a warp's
// 16 x 64 tile C += A B, A a 16 x 64 register fragment set, B read from a 64 x 64 shared tile.
// Probabilities and dS are rounded to bf16 before they multiply, as FlashAttention does.
// Outputs and lse match the CUDA-core kernels above (either forward feeds either backward).
// Fragment layouts: PTX ISA "Matrix Fragments for mma.m16n8k16" (g = lane / 4, t = lane % 4;
// A: rows g, g+8, cols 2t, 2t+1 and +8; B: rows 2t, 2t+1 and +8, col g; C: rows g, g+8, cols
// 2t, 2t+1).

#if defined(FT_HOST_EMULATION) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define FT_HAS_MMA 1
#endif

#if !defined(FT_HOST_EMULATION)
// d += a * b for one 16x8x16 bf16 tile (the host emulation brings its own).
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
#endif

#define TC_LD 72    // shared row stride in bf16 elements: 64 + 8 keeps fragment loads conflict-free

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  return (unsigned)bf16_bits(lo) | ((unsigned)bf16_bits(hi) << 16);
}
// Two consecutive bf16 (even element index, so 4-byte aligned) as one register.
__device__ __forceinline__ unsigned ld_pair(const unsigned short* p) {
  return *reinterpret_cast<const unsigned*>(p);
}

// Loads rows [row0, row0 + 64) (zeros from n on) of a [rows, stride] bf16 tensor into shared
// memory: row-major into `rm` ([row][dim]) and/or transposed into `tr` ([dim][row]).
__device__ __forceinline__ void tc_load(unsigned short* rm, unsigned short* tr, const bf16* src,
                                        long long row0, int n, int stride) {
  for (int e = threadIdx.x; e < 64 * 64; e += blockDim.x) {
    const int j = e / 64, d = e % 64;
    const unsigned short x = j < n ? src[(row0 + j) * stride + d].x : (unsigned short)0;
    if (rm) rm[j * TC_LD + d] = x;
    if (tr) tr[d * TC_LD + j] = x;
  }
}

// A fragments of 16 rows x 64 columns of a row-major shared tile (`tile` at the first row).
__device__ __forceinline__ void tc_frag_a(unsigned (*a)[4], const unsigned short* tile, int g,
                                          int t) {
  for (int kk = 0; kk < 4; kk++) {
    a[kk][0] = ld_pair(tile + g * TC_LD + kk * 16 + 2 * t);
    a[kk][1] = ld_pair(tile + (g + 8) * TC_LD + kk * 16 + 2 * t);
    a[kk][2] = ld_pair(tile + g * TC_LD + kk * 16 + 2 * t + 8);
    a[kk][3] = ld_pair(tile + (g + 8) * TC_LD + kk * 16 + 2 * t + 8);
  }
}

// c[16 x 64] += a[16 x 64] * B[64 x 64], with B given as its transpose `bt` ([n][k] row-major in
// shared memory, so B[k][n] = bt[n][k]).
__device__ __forceinline__ void tc_gemm(float (*c)[4], const unsigned (*a)[4],
                                        const unsigned short* bt, int g, int t) {
  for (int nt = 0; nt < 8; nt++)
    for (int kk = 0; kk < 4; kk++) {
      const unsigned short* r = bt + (nt * 8 + g) * TC_LD + kk * 16 + 2 * t;
      const unsigned bb[2] = {ld_pair(r), ld_pair(r + 8)};
      mma_bf16_16816(c[nt], a[kk], bb);
    }
}

// A 16 x 64 accumulator tile repacked as bf16 A fragments (column tile nt feeds step nt / 2).
__device__ __forceinline__ void tc_pack(unsigned (*a)[4], const float (*c)[4]) {
  for (int nt = 0; nt < 8; nt++) {
    a[nt / 2][(nt & 1) * 2] = pack_bf16(c[nt][0], c[nt][1]);
    a[nt / 2][(nt & 1) * 2 + 1] = pack_bf16(c[nt][2], c[nt][3]);
  }
}

__device__ __forceinline__ void tc_zero(float (*c)[4]) {
  for (int nt = 0; nt < 8; nt++)
    for (int i = 0; i < 4; i++) c[nt][i] = 0.f;
}

// Forward: per tile of 64 keys, S = Q K^T, online softmax, O += P V.
extern "C" __global__ void attn_fwd_tc_bf16(const bf16* q, const bf16* k, const bf16* v,
                                            const float* bias, bf16* o, float* lse, int heads,
                                            int lq, int lk, int kvs, float scale, long long sb,
                                            long long sh, long long sq, long long sk) {
#ifdef FT_HAS_MMA
  __shared__ __align__(16) unsigned short Ks[64 * TC_LD];
  __shared__ __align__(16) unsigned short Vt[64 * TC_LD];  // V transposed: [dim][key]
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = blockIdx.x * 64;
  const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;  // this thread's two query rows
  const float* b0p = (bias && r0 < lq) ? bias + b * sb + h * sh + (long long)r0 * sq : nullptr;
  const float* b1p = (bias && r1 < lq) ? bias + b * sb + h * sh + (long long)r1 * sq : nullptr;
  unsigned qa[4][4];
  tc_load(Ks, nullptr, q, (long long)bh * lq + q0, min(64, lq - q0), 64);  // Ks stages Q
  __syncthreads();
  tc_frag_a(qa, Ks + warp * 16 * TC_LD, g, t);
  float m0 = -FT_INF, m1 = -FT_INF, l0 = 0.f, l1 = 0.f;
  float acc[8][4], s[8][4];
  unsigned pa[4][4];
  tc_zero(acc);
  for (int t0 = 0; t0 < lk; t0 += 64) {
    const int n = min(64, lk - t0);
    __syncthreads();
    tc_load(Ks, nullptr, k, (long long)bh * lk + t0, n, kvs);
    tc_load(nullptr, Vt, v, (long long)bh * lk + t0, n, kvs);
    __syncthreads();
    tc_zero(s);
    tc_gemm(s, qa, Ks, g, t);
    float mx0 = -FT_INF, mx1 = -FT_INF;
    for (int nt = 0; nt < 8; nt++)
      for (int c = 0; c < 2; c++) {
        const int j = nt * 8 + 2 * t + c;
        float v0 = s[nt][c] * scale, v1 = s[nt][2 + c] * scale;
        if (j >= n) {
          v0 = -FT_INF;
          v1 = -FT_INF;
        } else {
          if (b0p) v0 += b0p[(t0 + j) * sk];
          if (b1p) v1 += b1p[(t0 + j) * sk];
        }
        s[nt][c] = v0;
        s[nt][2 + c] = v1;
        mx0 = fmaxf(mx0, v0);
        mx1 = fmaxf(mx1, v1);
      }
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o_));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o_));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    // Exponent bases: 0 while a row has seen only -inf scores (so exp gives 0, not NaN).
    const float e0 = mn0 == -FT_INF ? 0.f : mn0, e1 = mn1 == -FT_INF ? 0.f : mn1;
    const float c0 = __expf(m0 - e0), c1 = __expf(m1 - e1);
    l0 *= c0;
    l1 *= c1;
    for (int dn = 0; dn < 8; dn++) {
      acc[dn][0] *= c0;
      acc[dn][1] *= c0;
      acc[dn][2] *= c1;
      acc[dn][3] *= c1;
    }
    m0 = mn0;
    m1 = mn1;
    for (int nt = 0; nt < 8; nt++) {
      s[nt][0] = __expf(s[nt][0] - e0);
      s[nt][1] = __expf(s[nt][1] - e0);
      s[nt][2] = __expf(s[nt][2] - e1);
      s[nt][3] = __expf(s[nt][3] - e1);
      l0 += s[nt][0] + s[nt][1];
      l1 += s[nt][2] + s[nt][3];
    }
    tc_pack(pa, s);
    tc_gemm(acc, pa, Vt, g, t);
  }
  for (int o_ = 1; o_ <= 2; o_ <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o_);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o_);
  }
  const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
  for (int dn = 0; dn < 8; dn++) {
    const int d = dn * 8 + 2 * t;
    if (r0 < lq) {
      st(o, ((long long)bh * lq + r0) * 64 + d, acc[dn][0] * i0);
      st(o, ((long long)bh * lq + r0) * 64 + d + 1, acc[dn][1] * i0);
    }
    if (r1 < lq) {
      st(o, ((long long)bh * lq + r1) * 64 + d, acc[dn][2] * i1);
      st(o, ((long long)bh * lq + r1) * 64 + d + 1, acc[dn][3] * i1);
    }
  }
  if (t == 0) {
    if (r0 < lq) lse[(long long)bh * lq + r0] = l0 > 0.f ? m0 + __logf(l0) : -FT_INF;
    if (r1 < lq) lse[(long long)bh * lq + r1] = l1 > 0.f ? m1 + __logf(l1) : -FT_INF;
  }
#endif
}

// dQ (and the bias gradient): per tile of 64 keys, S = Q K^T and dP = dO V^T, then
// dS = P (dP - delta), dQ += dS K.
extern "C" __global__ void attn_bwd_q_tc_bf16(const bf16* q, const bf16* k, const bf16* v,
                                              const float* bias, const bf16* go,
                                              const float* lse, const float* delta, bf16* dq,
                                              float* dbias, int heads, int lq, int lk, int kvs,
                                              float scale, long long sb, long long sh,
                                              long long sq, long long sk) {
#ifdef FT_HAS_MMA
  __shared__ __align__(16) unsigned short Ks[64 * TC_LD];
  __shared__ __align__(16) unsigned short Kt[64 * TC_LD];  // K transposed: [dim][key]
  __shared__ __align__(16) unsigned short Vs[64 * TC_LD];
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = blockIdx.x * 64, nq = min(64, lq - q0);
  const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
  const bool in0 = r0 < lq, in1 = r1 < lq;
  const long long bo0 = b * sb + h * sh + (long long)(in0 ? r0 : 0) * sq;
  const long long bo1 = b * sb + h * sh + (long long)(in1 ? r1 : 0) * sq;
  const float L0 = in0 ? lse[(long long)bh * lq + r0] : -FT_INF;
  const float L1 = in1 ? lse[(long long)bh * lq + r1] : -FT_INF;
  const float D0 = in0 ? delta[(long long)bh * lq + r0] : 0.f;
  const float D1 = in1 ? delta[(long long)bh * lq + r1] : 0.f;
  unsigned qa[4][4], ga[4][4], da[4][4];
  tc_load(Ks, nullptr, q, (long long)bh * lq + q0, nq, 64);  // Ks stages Q, then dO
  __syncthreads();
  tc_frag_a(qa, Ks + warp * 16 * TC_LD, g, t);
  __syncthreads();
  tc_load(Ks, nullptr, go, (long long)bh * lq + q0, nq, 64);
  __syncthreads();
  tc_frag_a(ga, Ks + warp * 16 * TC_LD, g, t);
  float acc[8][4], s[8][4], dp[8][4];
  tc_zero(acc);
  for (int t0 = 0; t0 < lk; t0 += 64) {
    const int n = min(64, lk - t0);
    __syncthreads();
    tc_load(Ks, Kt, k, (long long)bh * lk + t0, n, kvs);
    tc_load(Vs, nullptr, v, (long long)bh * lk + t0, n, kvs);
    __syncthreads();
    tc_zero(s);
    tc_gemm(s, qa, Ks, g, t);
    tc_zero(dp);
    tc_gemm(dp, ga, Vs, g, t);
    for (int nt = 0; nt < 8; nt++)
      for (int c = 0; c < 2; c++) {
        const int j = nt * 8 + 2 * t + c;
        const bool key = j < n;
        float p0 = 0.f, p1 = 0.f;
        if (key && L0 != -FT_INF)
          p0 = __expf(s[nt][c] * scale + (bias ? bias[bo0 + (t0 + j) * sk] : 0.f) - L0);
        if (key && L1 != -FT_INF)
          p1 = __expf(s[nt][2 + c] * scale + (bias ? bias[bo1 + (t0 + j) * sk] : 0.f) - L1);
        const float ds0 = p0 * (dp[nt][c] - D0), ds1 = p1 * (dp[nt][2 + c] - D1);
        if (dbias && key) {
          if (in0) atomicAdd(dbias + bo0 + (t0 + j) * sk, ds0);
          if (in1) atomicAdd(dbias + bo1 + (t0 + j) * sk, ds1);
        }
        s[nt][c] = ds0;
        s[nt][2 + c] = ds1;
      }
    tc_pack(da, s);
    tc_gemm(acc, da, Kt, g, t);
  }
  for (int dn = 0; dn < 8; dn++) {
    const int d = dn * 8 + 2 * t;
    if (in0) {
      st(dq, ((long long)bh * lq + r0) * 64 + d, acc[dn][0] * scale);
      st(dq, ((long long)bh * lq + r0) * 64 + d + 1, acc[dn][1] * scale);
    }
    if (in1) {
      st(dq, ((long long)bh * lq + r1) * 64 + d, acc[dn][2] * scale);
      st(dq, ((long long)bh * lq + r1) * 64 + d + 1, acc[dn][3] * scale);
    }
  }
#endif
}

// dK, dV: a block takes 64 keys; per tile of 64 queries, S^T = K Q^T and dP^T = V dO^T, then
// dV += P^T dO, dS^T = P^T (dP^T - delta), dK += dS^T Q.
extern "C" __global__ void attn_bwd_kv_tc_bf16(const bf16* q, const bf16* k, const bf16* v,
                                               const float* bias, const bf16* go,
                                               const float* lse, const float* delta, bf16* dk,
                                               bf16* dv, int heads, int lq, int lk, int kvs,
                                               float scale, long long sb, long long sh,
                                               long long sq, long long sk) {
#ifdef FT_HAS_MMA
  __shared__ __align__(16) unsigned short Qs[64 * TC_LD];
  __shared__ __align__(16) unsigned short Qt[64 * TC_LD];  // [dim][query]
  __shared__ __align__(16) unsigned short Gs[64 * TC_LD];
  __shared__ __align__(16) unsigned short Gt[64 * TC_LD];  // dO transposed: [dim][query]
  __shared__ float ls[64], dls[64];
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int k0 = blockIdx.x * 64, nk = min(64, lk - k0);
  const int c0 = k0 + warp * 16 + g, c1 = c0 + 8;  // this thread's two key rows
  const bool in0 = c0 < lk, in1 = c1 < lk;
  const long long bo0 = b * sb + h * sh + (long long)(in0 ? c0 : 0) * sk;
  const long long bo1 = b * sb + h * sh + (long long)(in1 ? c1 : 0) * sk;
  unsigned ka[4][4], va[4][4], pa[4][4], da[4][4];
  tc_load(Qs, nullptr, k, (long long)bh * lk + k0, nk, kvs);  // Qs stages K, then V
  __syncthreads();
  tc_frag_a(ka, Qs + warp * 16 * TC_LD, g, t);
  __syncthreads();
  tc_load(Qs, nullptr, v, (long long)bh * lk + k0, nk, kvs);
  __syncthreads();
  tc_frag_a(va, Qs + warp * 16 * TC_LD, g, t);
  float dka[8][4], dva[8][4], s[8][4], dp[8][4];
  tc_zero(dka);
  tc_zero(dva);
  for (int i0 = 0; i0 < lq; i0 += 64) {
    const int n = min(64, lq - i0);
    __syncthreads();
    tc_load(Qs, Qt, q, (long long)bh * lq + i0, n, 64);
    tc_load(Gs, Gt, go, (long long)bh * lq + i0, n, 64);
    for (int i = threadIdx.x; i < 64; i += blockDim.x) {
      ls[i] = i < n ? lse[(long long)bh * lq + i0 + i] : -FT_INF;
      dls[i] = i < n ? delta[(long long)bh * lq + i0 + i] : 0.f;
    }
    __syncthreads();
    tc_zero(s);
    tc_gemm(s, ka, Qs, g, t);
    tc_zero(dp);
    tc_gemm(dp, va, Gs, g, t);
    for (int nt = 0; nt < 8; nt++)
      for (int c = 0; c < 2; c++) {
        const int i = nt * 8 + 2 * t + c;  // query within the tile
        const float L = ls[i];
        float p0 = 0.f, p1 = 0.f;
        if (L != -FT_INF) {
          const long long qi = (long long)(i0 + i) * sq;
          if (in0) p0 = __expf(s[nt][c] * scale + (bias ? bias[bo0 + qi] : 0.f) - L);
          if (in1) p1 = __expf(s[nt][2 + c] * scale + (bias ? bias[bo1 + qi] : 0.f) - L);
        }
        s[nt][c] = p0;
        s[nt][2 + c] = p1;
        dp[nt][c] = p0 * (dp[nt][c] - dls[i]);
        dp[nt][2 + c] = p1 * (dp[nt][2 + c] - dls[i]);
      }
    tc_pack(pa, s);
    tc_pack(da, dp);
    tc_gemm(dva, pa, Gt, g, t);
    tc_gemm(dka, da, Qt, g, t);
  }
  for (int dn = 0; dn < 8; dn++) {
    const int d = dn * 8 + 2 * t;
    if (in0) {
      const long long at = ((long long)bh * lk + c0) * kvs + d;
      st(dk, at, dka[dn][0] * scale);
      st(dk, at + 1, dka[dn][1] * scale);
      st(dv, at, dva[dn][0]);
      st(dv, at + 1, dva[dn][1]);
    }
    if (in1) {
      const long long at = ((long long)bh * lk + c1) * kvs + d;
      st(dk, at, dka[dn][2] * scale);
      st(dk, at + 1, dka[dn][3] * scale);
      st(dv, at, dva[dn][2]);
      st(dv, at + 1, dva[dn][3]);
    }
  }
#endif
}
