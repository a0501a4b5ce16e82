// Shared by every kernel file of this folder: the types, loads and stores of f32/bf16/f16,
// rounding to bf16 (to nearest and stochastic), warp and block reductions, and the rounded
// arithmetic the optimizer kernels share. The kernel files are compiled as one NVRTC program in
// the order of SOURCES in nvrtc.rs (this file first), with no CUDA headers, so the binaries need
// no toolkit on the user's machine; the same files compile as C++ on the host under
// kernels/tests/emulated/emu.h, which runs each block's threads as OS threads, so CI checks the
// kernels' logic without a GPU. Every kernel computes in f32 and reads/writes f32, bf16 or f16
// through ld/st. Row kernels take one block per row; element kernels a grid-stride loop.

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

// Counter-based hash (splitmix64 finaliser): output i of the splitmix64 stream starting at
// `seed`; the same (seed, index) always gives the same bits (`crate::rounding::rand_u64`).
__device__ __forceinline__ unsigned long long rand_u64(unsigned long long seed,
                                                       unsigned long long i) {
  unsigned long long z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ unsigned rand_bits(unsigned long long seed, unsigned long long i) {
  return (unsigned)(rand_u64(seed, i) >> 32);
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

// `x * a + 0` as candle's `affine` computes it, with rounded intrinsics: the compiler may not
// contract them into an FMA, which would round differently from the host.
__device__ __forceinline__ float affine0(float x, float a) {
  return __fadd_rn(__fmul_rn(x, a), 0.f);
}

// Instantiates an entry-point macro M(T, S) for each storage type and its suffix.
#define FT_FOR_DTYPES(M) M(float, f32) M(bf16, bf16) M(f16, f16)
