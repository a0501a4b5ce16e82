// fp32 -> bf16 with stochastic rounding (bf16_bits_stochastic of prelude.cuh over a tensor).
// Launcher: rounding.rs.

__device__ void round_stochastic(const float* x, bf16* y, long long n, unsigned long long seed) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    y[i].x = bf16_bits_stochastic(x[i], rand_bits(seed, i));
}

extern "C" __global__ void round_stochastic_bf16(const float* x, bf16* y, long long n,
                                                 unsigned long long seed) {
  round_stochastic(x, y, n, seed);
}
