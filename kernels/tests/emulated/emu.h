// Host emulation of the CUDA features the kernel files (src/cuda/*.cu) use, so that the
// kernels' logic (indexing, reductions, online softmax, barriers) is tested on any machine with a
// C++20 compiler.
//
// A launch runs the grid's blocks one after another; the threads of a block run as OS threads,
// so `__syncthreads`, warp shuffles and shared memory behave as on a GPU (shared memory is a
// function-local `static`: one copy, reused by each block in turn). Timing says nothing here.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define FT_HOST_EMULATION 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static

struct alignas(16) float4 {
  float x, y, z, w;
};
#define __align__(n) __attribute__((aligned(n)))

struct Dim {
  unsigned x = 1, y = 1, z = 1;
};

struct Block {
  explicit Block(unsigned n)
      : all((std::ptrdiff_t)n), warps() {
    for (unsigned w = 0; w < (n + 31) / 32; w++) {
      unsigned members = std::min(32u, n - 32 * w);
      warps.push_back(std::make_unique<std::barrier<>>((std::ptrdiff_t)members));
    }
  }
  std::barrier<> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  float slots[1024];
  unsigned mma_a[1024][4], mma_b[1024][2];
  std::atomic<int> any{0};
};

inline thread_local Dim threadIdx, blockIdx;
inline Dim blockDim, gridDim;
inline thread_local Block* cur_block = nullptr;
inline std::mutex atomics;

inline void __syncthreads() { cur_block->all.arrive_and_wait(); }

inline int __syncthreads_or(int p) {
  if (p) cur_block->any.store(1);
  __syncthreads();
  int r = cur_block->any.load();
  __syncthreads();
  if (threadIdx.x == 0) cur_block->any.store(0);
  __syncthreads();
  return r;
}

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  const unsigned t = threadIdx.x, base = t & ~31u, lane = t & 31u;
  auto& bar = *cur_block->warps[t / 32];
  cur_block->slots[t] = v;
  bar.arrive_and_wait();
  float r = cur_block->slots[base + (lane ^ (unsigned)lane_mask)];
  bar.arrive_and_wait();
  return r;
}

inline float atomicAdd(float* p, float v) {
  std::lock_guard<std::mutex> g(atomics);
  float old = *p;
  *p = old + v;
  return old;
}

inline double atomicAdd(double* p, double v) {
  std::lock_guard<std::mutex> g(atomics);
  double old = *p;
  *p = old + v;
  return old;
}

// The compare-and-swap behind the pre-sm_60 double atomicAdd (grad_norm.cu's atomic_add_f64 when
// built with -D__CUDA_ARCH__=520). It yields first, so that other threads get between a
// caller's read and its swap and the retry loop is really exercised; `cas_retries` counts the
// swaps that found the word changed.
inline std::atomic<long long> cas_retries{0};
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long compare,
                                    unsigned long long v) {
  std::this_thread::yield();
  std::lock_guard<std::mutex> g(atomics);
  unsigned long long old = *p;
  if (old == compare) *p = v;
  else cas_retries++;
  return old;
}
inline long long __double_as_longlong(double d) {
  long long i;
  std::memcpy(&i, &d, 8);
  return i;
}
inline double __longlong_as_double(long long i) {
  double d;
  std::memcpy(&d, &i, 8);
  return d;
}

inline int atomicExch(int* p, int v) {
  std::lock_guard<std::mutex> g(atomics);
  int old = *p;
  *p = v;
  return old;
}

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __uint_as_float(unsigned i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned i;
  std::memcpy(&i, &f, 4);
  return i;
}
// Rounded arithmetic intrinsics: on the host plain IEEE operations (an ISO C++ build does not
// contract them into FMAs).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }

inline float f16_to_f32(unsigned short h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return (float)v;
}
inline unsigned short f32_to_f16(float f) {
  _Float16 v = (_Float16)f;
  unsigned short h;
  std::memcpy(&h, &v, 2);
  return h;
}

// mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32 for one warp, d += a * b: each lane posts its
// fragment registers, every lane rebuilds the 16x16 A and 16x8 B tiles from the PTX ISA's
// fragment layout and computes its own four accumulator elements.
inline void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
  const unsigned tid = threadIdx.x, base = tid & ~31u, lane = tid & 31u;
  Block& blk = *cur_block;
  auto& bar = *blk.warps[tid / 32];
  for (int i = 0; i < 4; i++) blk.mma_a[tid][i] = a[i];
  for (int i = 0; i < 2; i++) blk.mma_b[tid][i] = b[i];
  bar.arrive_and_wait();
  auto bf = [](unsigned bits) { return __uint_as_float(bits << 16); };
  float A[16][16], B[16][8];
  for (unsigned L = 0; L < 32; L++) {
    const unsigned g = L >> 2, t = L & 3;
    const unsigned* ra = blk.mma_a[base + L];
    const unsigned* rb = blk.mma_b[base + L];
    const unsigned rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int r = 0; r < 4; r++) {
      A[rows[r]][cols[r]] = bf(ra[r] & 0xffffu);
      A[rows[r]][cols[r] + 1] = bf(ra[r] >> 16);
    }
    for (int r = 0; r < 2; r++) {
      B[2 * t + 8 * r][g] = bf(rb[r] & 0xffffu);
      B[2 * t + 8 * r + 1][g] = bf(rb[r] >> 16);
    }
  }
  bar.arrive_and_wait();
  const unsigned g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; i++) {
    const unsigned row = i < 2 ? g : g + 8, col = 2 * t + (i & 1);
    float acc = 0.f;
    for (int kk = 0; kk < 16; kk++) acc += A[row][kk] * B[kk][col];
    d[i] += acc;
  }
}

// Runs `kernel` (a callable running one thread's work) over the grid.
inline void launch(Dim grid, Dim block, const std::function<void()>& kernel) {
  gridDim = grid;
  blockDim = block;
  for (unsigned by = 0; by < grid.y; by++)
    for (unsigned bx = 0; bx < grid.x; bx++) {
      Block b(block.x);
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < block.x; t++)
        threads.emplace_back([&, t] {
          threadIdx = Dim{t, 0, 0};
          blockIdx = Dim{bx, by, 0};
          cur_block = &b;
          kernel();
        });
      for (auto& th : threads) th.join();
    }
}
