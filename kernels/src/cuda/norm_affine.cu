// A norm with its affine part and the activation after it (crate::norm_affine's op), forward:
// one block per row of `cols` values (the last dimension, or one group of [N, C, *]); the
// channel of column j of row r is (r % groups) * per_group + j / inner. Each value rounds where
// the separate ops would: the normalised value, the product with the weight, the sum with the
// bias, the activation (`act` as gated.cu's codes; -1 none). A null `w` or `b`: no weight or
// bias. The backward is composed on the device from norm.cu's kernels (norm_affine.rs).
// Launcher: norm_affine.rs.

template <typename T>
__device__ void norm_affine_fwd(const T* x, const T* w, const T* b, T* y, int cols, int groups,
                                int per_group, int inner, float eps, int center, int act) {
  const long long base = (long long)blockIdx.x * cols;
  float mean, r;
  row_stats(x, base, cols, eps, center, &mean, &r);
  const int c0 = (int)(blockIdx.x % (unsigned)groups) * per_group;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const int c = c0 + j / inner;
    float z = round_as<T>(__fmul_rn(ld(x, base + j) - mean, r));
    if (w) z = round_as<T>(__fmul_rn(z, ld(w, c)));
    if (b) z = round_as<T>(__fadd_rn(z, ld(b, c)));
    st(y, base + j, act >= 0 ? gated_act(act, z) : z);
  }
}

#define NORM_AFFINE(T, S)                                                                       \
  extern "C" __global__ void norm_affine_fwd_##S(const T* x, const T* w, const T* b, T* y,      \
                                                 int cols, int groups, int per_group, int inner, \
                                                 float eps, int center, int act) {               \
    norm_affine_fwd(x, w, b, y, cols, groups, per_group, inner, eps, center, act);              \
  }
FT_FOR_DTYPES(NORM_AFFINE)
