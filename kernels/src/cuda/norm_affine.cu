// A norm with its affine part and the activation after it (crate::norm_affine's op), forward and
// backward: one block per row of `cols` values (the last dimension, or one group of [N, C, *]); the
// channel of column j of row r is (r % groups) * per_group + j / inner. Each value rounds where
// the separate ops would: the normalised value, the product with the weight, the sum with the
// bias, the activation (`act` as gated.cu's codes; -1 none). A null `w` or `b`: no weight or
// bias. The backward: two kernels below.
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

// The backward. The gradient reaching x-hat of one value: act'(z) g, times the weight, with z
// rebuilt as the forward rounded it.
template <typename T>
__device__ __forceinline__ float norm_affine_dz(const T* w, const T* b, int c, float xhat, float g,
                                                int act) {
  if (act < 0) return g;
  float z = xhat;
  if (w) z = round_as<T>(__fmul_rn(z, ld(w, c)));
  if (b) z = round_as<T>(__fadd_rn(z, ld(b, c)));
  return gated_grad(act, g, z);
}

// Pass 1, one block per row: the input's gradient dx = r (d - mean(d) - xe mean(d xe)) with
// d = w dz and xe the unrounded normalised value (RMS norm: no mean(d)), and the row's mean and
// r kept in `stats` for pass 2.
template <typename T>
__device__ void norm_affine_bwd_x(const T* x, const T* g, const T* w, const T* b, T* dx,
                                  float* stats, int cols, int groups, int per_group, int inner,
                                  float eps, int center, int act) {
  const long long base = (long long)blockIdx.x * cols;
  float mean, r;
  row_stats(x, base, cols, eps, center, &mean, &r);
  const int c0 = (int)(blockIdx.x % (unsigned)groups) * per_group;
  float s1 = 0.f, s2 = 0.f;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const int c = c0 + j / inner;
    const float xe = __fmul_rn(ld(x, base + j) - mean, r);
    const float dz = norm_affine_dz(w, b, c, round_as<T>(xe), ld(g, base + j), act);
    const float d = w ? dz * ld(w, c) : dz;
    s1 += d;
    s2 += d * xe;
  }
  s1 = center ? block_sum(s1) / cols : 0.f;
  s2 = block_sum(s2) / cols;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const int c = c0 + j / inner;
    const float xe = __fmul_rn(ld(x, base + j) - mean, r);
    const float dz = norm_affine_dz(w, b, c, round_as<T>(xe), ld(g, base + j), act);
    const float d = w ? dz * ld(w, c) : dz;
    st(dx, base + j, r * (d - s1 - xe * s2));
  }
  if (threadIdx.x == 0) {
    stats[2 * (long long)blockIdx.x] = mean;
    stats[2 * (long long)blockIdx.x + 1] = r;
  }
}

// Pass 2, one block per channel: the weight's gradient sum(dz xhat) (xhat rounded as the
// forward used it) and the bias's sum(dz) over the channel's values in every row, in a fixed
// order (no atomics: the same sums every run). A null `db`: no bias.
template <typename T>
__device__ void norm_affine_bwd_params(const T* x, const T* g, const T* w, const T* b,
                                       const float* stats, float* dw, float* db, int rows,
                                       int cols, int groups, int per_group, int inner, int act) {
  const int c = blockIdx.x, grp = c / per_group, k = c % per_group;
  const long long values = (long long)(rows / groups) * inner;
  float sw = 0.f, sb = 0.f;
  for (long long e = threadIdx.x; e < values; e += blockDim.x) {
    const long long row = (e / inner) * groups + grp;
    const long long at = row * cols + (long long)k * inner + e % inner;
    const float xhat = round_as<T>(__fmul_rn(ld(x, at) - stats[2 * row], stats[2 * row + 1]));
    const float dz = norm_affine_dz(w, b, c, xhat, ld(g, at), act);
    sw += dz * xhat;
    sb += dz;
  }
  sw = block_sum(sw);
  sb = block_sum(sb);
  if (threadIdx.x == 0) {
    dw[c] = sw;
    if (db) db[c] = sb;
  }
}

#define NORM_AFFINE_BWD(T, S)                                                                  \
  extern "C" __global__ void norm_affine_bwd_x_##S(                                            \
      const T* x, const T* g, const T* w, const T* b, T* dx, float* stats, int cols,           \
      int groups, int per_group, int inner, float eps, int center, int act) {                  \
    norm_affine_bwd_x(x, g, w, b, dx, stats, cols, groups, per_group, inner, eps, center, act); \
  }                                                                                            \
  extern "C" __global__ void norm_affine_bwd_params_##S(                                       \
      const T* x, const T* g, const T* w, const T* b, const float* stats, float* dw,           \
      float* db, int rows, int cols, int groups, int per_group, int inner, int act) {          \
    norm_affine_bwd_params(x, g, w, b, stats, dw, db, rows, cols, groups, per_group, inner,    \
                           act);                                                               \
  }
FT_FOR_DTYPES(NORM_AFFINE_BWD)
