// Tensor-core attention (bf16, 64-dim heads, sm_80+). Launcher: attention.rs.
//
// FlashAttention-2 with mma.sync.m16n8k16 (bf16 in, f32 accumulate). A block has 4 warps and
// 64 rows (queries, or keys in the dK/dV kernel), 16 per warp; each product is a warp's
// 16 x 64 tile C += A B, A a 16 x 64 register fragment set, B read from a 64 x 64 shared tile.
// Probabilities and dS are rounded to bf16 before they multiply, as FlashAttention does.
// Outputs and lse match the CUDA-core kernels of attention.cu (either forward feeds either backward).
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
