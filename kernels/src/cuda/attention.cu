// Memory-efficient attention on CUDA cores (head dim 64, f32/bf16/f16), forward and backward.
// The tensor-core versions are in attention_tc.cu. Launcher: attention.rs.
//
// Head dim D, one thread per query or key row. q [BH, Lq, D]; k, v rows of `kvs` elements (K and V packed side by side: kvs = 2 D); bias
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

#define ATTENTION(T, S)                                                                         \
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

FT_FOR_DTYPES(ATTENTION)
