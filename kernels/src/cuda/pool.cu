// Max and average pooling of [N*C, H, W] planes, forward and backward: grid-stride loops.
// Launcher: pool.rs.

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

#define POOL(T, S)                                                                              \
  extern "C" __global__ void pool_fwd_##S(const T* x, T* y, long long p, int h, int w, int kh,  \
                                          int kw, int sh, int sw, int kind) {                   \
    pool_fwd(x, y, p, h, w, kh, kw, sh, sw, kind);                                              \
  }                                                                                             \
  extern "C" __global__ void pool_bwd_##S(const T* x, const T* g, T* dx, long long p, int h,    \
                                          int w, int kh, int kw, int sh, int sw, int kind) {    \
    pool_bwd(x, g, dx, p, h, w, kh, kw, sh, sw, kind);                                          \
  }
FT_FOR_DTYPES(POOL)
