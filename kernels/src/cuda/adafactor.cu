// Adafactor with factored second moments, in five or six launches per tensor. Launcher:
// adafactor.rs.
//
// transformers' Adafactor update as trainer/src/optim/adafactor.rs computes it on the host, for the
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
