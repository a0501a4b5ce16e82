// Runs the kernels of kernels/src/cuda/kernels.cu under the host emulation (emu.h) and compares
// each with a plain double-precision reference written here. Launch geometry follows the Rust
// launchers in kernels/src/cuda. Exit status 0 when every check passes; driven by
// kernels/tests/emulated.rs.
#include <unistd.h>

#include <cstdio>
#include <string>

#include "emu.h"
#include "../../src/cuda/kernels.cu"

static int failures = 0;

static std::vector<float> rnd(size_t n, unsigned long long seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++) {
    unsigned long long z = seed * 0x9E3779B97F4A7C15ull + (i + 1) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
    v[i] = (float)((double)(z >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
  }
  return v;
}

// Values rounded through T, as the kernel will see them.
template <typename T>
static std::vector<T> to(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); i++) st(out.data(), (long long)i, v[i]);
  return out;
}
template <typename T>
static std::vector<float> back(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); i++) out[i] = ld(v.data(), (long long)i);
  return out;
}

static void check(const std::string& name, const std::vector<float>& got,
                  const std::vector<double>& want, double tol) {
  double err = 0, scale = 1e-12;
  for (size_t i = 0; i < want.size(); i++) {
    err = std::max(err, std::fabs((double)got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  const bool bad = got.size() != want.size() || !(err / scale <= tol);
  std::printf("%-48s rel err %.2e %s\n", name.c_str(), err / scale, bad ? "FAIL" : "ok");
  failures += bad;
}

static unsigned row_block(int cols) {
  unsigned b = (unsigned)((cols + 31) / 32 * 32);
  return std::min(512u, std::max(32u, b));
}

// ---- softmax ------------------------------------------------------------------------------

template <typename T>
static void softmax_case(const std::string& ty, int rows, int cols, int log_, double tol,
                         void (*fwd)(const T*, T*, int, int),
                         void (*bwd)(const T*, const T*, T*, int, int)) {
  auto x = to<T>(rnd((size_t)rows * cols, 1 + cols));
  auto g = to<T>(rnd((size_t)rows * cols, 2 + cols));
  auto xf = back(x), gf = back(g);
  std::vector<T> y(x.size()), dx(x.size());
  launch({(unsigned)rows}, {row_block(cols)}, [&] { fwd(x.data(), y.data(), cols, log_); });
  std::vector<double> want(x.size()), dwant(x.size());
  for (int r = 0; r < rows; r++) {
    double m = -INFINITY, s = 0;
    for (int c = 0; c < cols; c++) m = std::max(m, (double)xf[r * cols + c]);
    for (int c = 0; c < cols; c++) s += std::exp(xf[r * cols + c] - m);
    double sg = 0;
    for (int c = 0; c < cols; c++) {
      const int i = r * cols + c;
      want[i] = log_ ? xf[i] - m - std::log(s) : std::exp(xf[i] - m) / s;
      sg += log_ ? gf[i] : gf[i] * want[i];
    }
    for (int c = 0; c < cols; c++) {
      const int i = r * cols + c;
      dwant[i] = log_ ? gf[i] - std::exp(want[i]) * sg : want[i] * (gf[i] - sg);
    }
  }
  const std::string n = ty + (log_ ? " log_softmax " : " softmax ") + std::to_string(cols);
  check(n + " fwd", back(y), want, tol);
  // The backward reads the forward's stored (rounded) output, as in training.
  launch({(unsigned)rows}, {row_block(cols)}, [&] { bwd(y.data(), g.data(), dx.data(), cols, log_); });
  check(n + " bwd", back(dx), dwant, tol * 4);
}

// ---- layer / RMS norm ---------------------------------------------------------------------

template <typename T>
static void norm_case(const std::string& ty, int rows, int cols, int center, double tol,
                      void (*fwd)(const T*, T*, int, float, int),
                      void (*bwd)(const T*, const T*, T*, int, float, int)) {
  const float eps = 1e-5f;
  auto x = to<T>(rnd((size_t)rows * cols, 3 + cols));
  auto g = to<T>(rnd((size_t)rows * cols, 4 + cols));
  auto xf = back(x), gf = back(g);
  std::vector<T> y(x.size()), dx(x.size());
  launch({(unsigned)rows}, {row_block(cols)}, [&] { fwd(x.data(), y.data(), cols, eps, center); });
  launch({(unsigned)rows}, {row_block(cols)},
         [&] { bwd(x.data(), g.data(), dx.data(), cols, eps, center); });
  std::vector<double> want(x.size()), dwant(x.size());
  for (int r = 0; r < rows; r++) {
    const float* xr = &xf[(size_t)r * cols];
    const float* gr = &gf[(size_t)r * cols];
    double mean = 0, var = 0;
    if (center) {
      for (int c = 0; c < cols; c++) mean += xr[c];
      mean /= cols;
    }
    for (int c = 0; c < cols; c++) var += (xr[c] - mean) * (xr[c] - mean);
    var /= cols;
    const double rs = 1.0 / std::sqrt(var + eps);
    double mg = 0, mgx = 0;
    for (int c = 0; c < cols; c++) {
      mg += gr[c];
      mgx += gr[c] * (xr[c] - mean) * rs;
    }
    mg = center ? mg / cols : 0;
    mgx /= cols;
    for (int c = 0; c < cols; c++) {
      const double xh = (xr[c] - mean) * rs;
      want[(size_t)r * cols + c] = xh;
      dwant[(size_t)r * cols + c] = rs * (gr[c] - mg - xh * mgx);
    }
  }
  const std::string n = ty + (center ? " layer_norm " : " rms_norm ") + std::to_string(cols);
  check(n + " fwd", back(y), want, tol);
  check(n + " bwd", back(dx), dwant, tol * 4);
}

// ---- upsample and pooling -----------------------------------------------------------------

static unsigned grid_for(long long n) { return (unsigned)std::min<long long>((n + 255) / 256, 3); }

static void upsample_case() {
  const int planes = 3, h = 5, w = 7;
  auto x = rnd((size_t)planes * h * w, 5);
  auto g = rnd((size_t)planes * 4 * h * w, 6);
  std::vector<float> y(g.size()), dx(x.size());
  launch({grid_for(y.size())}, {256}, [&] { upsample2x_fwd_f32(x.data(), y.data(), planes, h, w); });
  launch({grid_for(x.size())}, {256}, [&] { upsample2x_bwd_f32(g.data(), dx.data(), planes, h, w); });
  std::vector<double> want(y.size()), dwant(x.size(), 0.0);
  for (int p = 0; p < planes; p++)
    for (int oy = 0; oy < 2 * h; oy++)
      for (int ox = 0; ox < 2 * w; ox++) {
        const size_t o = ((size_t)p * 2 * h + oy) * 2 * w + ox, i = ((size_t)p * h + oy / 2) * w + ox / 2;
        want[o] = x[i];
        dwant[i] += g[o];
      }
  check("f32 upsample2x fwd", y, want, 0);
  check("f32 upsample2x bwd", dx, dwant, 1e-6);
}

static void pool_case(int kh, int kw, int sh, int sw, int kind, int h, int w) {
  const int planes = 4, oh = (h - kh) / sh + 1, ow = (w - kw) / sw + 1;
  auto x = rnd((size_t)planes * h * w, 7 + h);
  auto g = rnd((size_t)planes * oh * ow, 8 + w);
  std::vector<float> y(g.size()), dx(x.size());
  launch({grid_for(y.size())}, {256},
         [&] { pool_fwd_f32(x.data(), y.data(), planes, h, w, kh, kw, sh, sw, kind); });
  launch({grid_for(x.size())}, {256},
         [&] { pool_bwd_f32(x.data(), g.data(), dx.data(), planes, h, w, kh, kw, sh, sw, kind); });
  std::vector<double> want(y.size()), dwant(x.size(), 0.0);
  for (int p = 0; p < planes; p++)
    for (int oy = 0; oy < oh; oy++)
      for (int ox = 0; ox < ow; ox++) {
        double best = -INFINITY, sum = 0;
        size_t at = 0;
        for (int dy = 0; dy < kh; dy++)
          for (int dxx = 0; dxx < kw; dxx++) {
            const size_t i = ((size_t)p * h + oy * sh + dy) * w + ox * sw + dxx;
            sum += x[i];
            if (x[i] > best) {
              best = x[i];
              at = i;
            }
          }
        const size_t o = ((size_t)p * oh + oy) * ow + ox;
        want[o] = kind == 0 ? best : sum / (kh * kw);
        if (kind == 0) {
          dwant[at] += g[o];
        } else {
          for (int dy = 0; dy < kh; dy++)
            for (int dxx = 0; dxx < kw; dxx++)
              dwant[((size_t)p * h + oy * sh + dy) * w + ox * sw + dxx] += g[o] / (kh * kw);
        }
      }
  const std::string n = std::string(kind == 0 ? "f32 max_pool " : "f32 avg_pool ") +
                        std::to_string(kh) + "x" + std::to_string(kw) + "/" + std::to_string(sh);
  check(n + " fwd", y, want, 1e-6);
  check(n + " bwd", dx, dwant, 1e-6);
}

// ---- attention ----------------------------------------------------------------------------

struct AttnCase {
  int b, h, lq, lk;
  float scale;
  int bias_kind;  // 0 none, 1 [1, H, Lq, Lk] position bias, 2 [B, 1, 1, Lk] mask (-1e9 / -inf)
  bool inf_mask;
};

template <typename T>
static void attention_case(const std::string& ty, const AttnCase& c, double tol,
                           void (*fwd)(const T*, const T*, const T*, const float*, T*, float*, int,
                                       int, int, int, float, long long, long long, long long,
                                       long long),
                           void (*delta)(const T*, const T*, float*, long long),
                           void (*bq)(const T*, const T*, const T*, const float*, const T*,
                                      const float*, const float*, T*, float*, int, int, int, int,
                                      float, long long, long long, long long, long long),
                           void (*bkv)(const T*, const T*, const T*, const float*, const T*,
                                       const float*, const float*, T*, T*, int, int, int, int,
                                       float, long long, long long, long long, long long),
                           unsigned fwd_block = 64, unsigned bwd_block = 128) {
  const int D = 64, BH = c.b * c.h, kvs = 2 * D;
  auto q = to<T>(rnd((size_t)BH * c.lq * D, 11));
  auto kv = to<T>(rnd((size_t)BH * c.lk * kvs, 12));
  auto go = to<T>(rnd((size_t)BH * c.lq * D, 13));
  auto qf = back(q), kvf = back(kv), gof = back(go);
  // Bias and its broadcast strides over [B, H, Lq, Lk].
  std::vector<float> bias;
  long long sb = 0, sh = 0, sq = 0, sk = 0;
  if (c.bias_kind == 1) {
    bias = rnd((size_t)c.h * c.lq * c.lk, 14);
    sh = (long long)c.lq * c.lk, sq = c.lk, sk = 1;
  } else if (c.bias_kind == 2) {
    bias.assign((size_t)c.b * c.lk, 0.f);
    const float neg = c.inf_mask ? -INFINITY : -1e9f;
    for (int j = c.lk - 9; j < c.lk; j++) bias[(size_t)(c.b - 1) * c.lk + j] = neg;
    if (c.inf_mask)  // every key of batch 0 masked: its rows must give zeros
      for (int j = 0; j < c.lk; j++) bias[j] = neg;
    sb = c.lk, sk = 1;
  }
  const float* bp = bias.empty() ? nullptr : bias.data();
  auto bias_at = [&](int b, int h, int i, int j) -> double {
    return bp ? bias[b * sb + h * sh + i * sq + j * sk] : 0.0;
  };

  std::vector<T> o((size_t)BH * c.lq * D), dq(o.size()), dkv(kv.size());
  std::vector<float> lse((size_t)BH * c.lq), dl(lse.size());
  std::vector<float> dbias(bias.size(), 0.f);
  const Dim gq{(unsigned)((c.lq + 63) / 64), (unsigned)BH}, gk{(unsigned)((c.lk + 63) / 64), (unsigned)BH};
  const T* k = kv.data();
  const T* v = kv.data() + D;
  launch(gq, {fwd_block}, [&] {
    fwd(q.data(), k, v, bp, o.data(), lse.data(), c.h, c.lq, c.lk, kvs, c.scale, sb, sh, sq, sk);
  });
  const long long rows = (long long)BH * c.lq;
  launch({(unsigned)((rows + 127) / 128)}, {128}, [&] { delta(o.data(), go.data(), dl.data(), rows); });
  launch(gq, {bwd_block}, [&] {
    bq(q.data(), k, v, bp, go.data(), lse.data(), dl.data(), dq.data(), bp ? dbias.data() : nullptr,
       c.h, c.lq, c.lk, kvs, c.scale, sb, sh, sq, sk);
  });
  launch(gk, {bwd_block}, [&] {
    bkv(q.data(), k, v, bp, go.data(), lse.data(), dl.data(), dkv.data(), dkv.data() + D, c.h, c.lq,
        c.lk, kvs, c.scale, sb, sh, sq, sk);
  });

  // Reference: full matrices in double.
  std::vector<double> wo(o.size(), 0.0), wdq(o.size(), 0.0), wdkv(kv.size(), 0.0),
      wdb(bias.size(), 0.0);
  std::vector<double> p(c.lk), dp(c.lk);
  for (int bh = 0; bh < BH; bh++) {
    const int b = bh / c.h, h = bh % c.h;
    auto K = [&](int j, int d) { return (double)kvf[((size_t)bh * c.lk + j) * kvs + d]; };
    auto V = [&](int j, int d) { return (double)kvf[((size_t)bh * c.lk + j) * kvs + D + d]; };
    for (int i = 0; i < c.lq; i++) {
      const float* qi = &qf[((size_t)bh * c.lq + i) * D];
      const float* gi = &gof[((size_t)bh * c.lq + i) * D];
      double m = -INFINITY;
      for (int j = 0; j < c.lk; j++) {
        double s = 0;
        for (int d = 0; d < D; d++) s += qi[d] * K(j, d);
        p[j] = s * c.scale + bias_at(b, h, i, j);
        m = std::max(m, p[j]);
      }
      if (m == -INFINITY) continue;  // fully masked row: zeros everywhere
      double l = 0;
      for (int j = 0; j < c.lk; j++) l += (p[j] = std::exp(p[j] - m));
      double rowdot = 0;
      for (int j = 0; j < c.lk; j++) {
        p[j] /= l;
        double t = 0;
        for (int d = 0; d < D; d++) t += gi[d] * V(j, d);
        dp[j] = t;
        rowdot += p[j] * t;
      }
      double* oi = &wo[((size_t)bh * c.lq + i) * D];
      for (int j = 0; j < c.lk; j++) {
        const double ds = p[j] * (dp[j] - rowdot);
        for (int d = 0; d < D; d++) {
          oi[d] += p[j] * V(j, d);
          wdq[((size_t)bh * c.lq + i) * D + d] += c.scale * ds * K(j, d);
          wdkv[((size_t)bh * c.lk + j) * kvs + d] += c.scale * ds * qi[d];
          wdkv[((size_t)bh * c.lk + j) * kvs + D + d] += p[j] * gi[d];
        }
        if (bp) wdb[b * sb + h * sh + i * sq + j * sk] += ds;
      }
    }
  }
  std::string n = ty + " attention " + std::to_string(c.lq) + "x" + std::to_string(c.lk) +
                  (c.bias_kind == 1 ? " bias" : c.bias_kind == 2 ? (c.inf_mask ? " -inf mask" : " mask") : "");
  check(n + " out", back(o), wo, tol);
  check(n + " dq", back(dq), wdq, tol * 2);
  check(n + " dk,dv", back(dkv), wdkv, tol * 2);
  if (bp) check(n + " dbias", dbias, wdb, tol * 2);
}

// ---- optimizer and casts ------------------------------------------------------------------

static void adamw_case() {
  const int n = 777;
  auto master = rnd(n, 20), m = rnd(n, 21), v = rnd(n, 22), g32 = rnd(n, 23);
  for (auto& x : v) x = std::fabs(x);
  auto g = to<bf16>(g32);
  auto gf = back(g);
  std::vector<bf16> model(n);
  for (int first = 1; first >= 0; first--) {
    const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01, gm = 0.5;
    const int t = first ? 1 : 5;
    const double step = lr / (1 - std::pow(b1, t)), bc2 = std::sqrt(1 - std::pow(b2, t));
    std::vector<double> wm(n), wv(n), wp(n), wmodel(n);
    for (int i = 0; i < n; i++) {
      const double gi = gf[i] * gm;
      const double mp = first ? 0 : m[i], vp = first ? 0 : v[i];
      wm[i] = b1 * mp + (1 - b1) * gi;
      wv[i] = b2 * vp + (1 - b2) * gi * gi;
      wp[i] = master[i] * (1 - lr * wd) - step * wm[i] / (std::sqrt(wv[i]) / bc2 + eps);
    }
    launch({2}, {256}, [&] {
      adamw_bf16_bf16(master.data(), m.data(), v.data(), g.data(), model.data(), n,
                      1 - lr * wd, b1, b2, 1 - b1, 1 - b2, eps, step, 1 / bc2, gm, first, 0);
    });
    for (int i = 0; i < n; i++) wmodel[i] = back(to<bf16>({master[i]}))[0];
    const std::string s = first ? "adamw first step" : "adamw later step";
    check(s + " exp_avg", m, wm, 1e-6);
    check(s + " exp_avg_sq", v, wv, 1e-6);
    check(s + " master", master, wp, 1e-6);
    check(s + " bf16 weight = rounded master", back(model), wmodel, 0);
  }
}

// Two ascending 256-value maps with 0 and 1 in them (signed, then unsigned), of dyadic values
// so that the midpoint of two neighbours is exact: a tie.
static std::vector<float> test_maps() {
  std::vector<float> maps(512);
  for (int k = 0; k < 256; k++) {
    const float s = (float)(k - 127) / 128.f, u = (float)k / 256.f;
    maps[k] = s * s * s;  // 0 at 127
    maps[256 + k] = k == 255 ? 1.f : u * u;
  }
  return maps;
}

// The 8-bit code of `x` in a block of maximum `max` by a linear scan: the nearest map value,
// the lowest index on a tie; NaN or a zero block gives the code of 0, an inf an extreme.
static unsigned char ref_code(const float* map, float x, float max) {
  x = (std::isnan(x) || max == 0.f) ? 0.f : std::clamp(x / max, -1.f, 1.f);
  int best = 0;
  for (int k = 1; k < 256; k++)
    if (std::fabs(x - map[k]) < std::fabs(x - map[best])) best = k;
  return (unsigned char)best;
}

// The kernel's code search against the scan on every map value, every midpoint (ties), points
// just beside them, and the out-of-range and non-finite inputs.
static void quantize_codes_case() {
  const auto maps = test_maps();
  int bad = 0, ties = 0;
  for (int which = 0; which < 2; which++) {
    const float* map = maps.data() + 256 * which;
    std::vector<float> xs = {0.f, -0.f, 2.f, -2.f, INFINITY, -INFINITY, NAN};
    for (int k = 0; k < 256; k++) {
      xs.push_back(map[k]);
      if (k == 255) continue;
      const float mid = (map[k] + map[k + 1]) / 2;
      ties += mid - map[k] == map[k + 1] - mid;
      xs.insert(xs.end(), {mid, std::nextafter(mid, -1.f), std::nextafter(mid, 2.f)});
    }
    for (float x : xs) bad += quantize_code(map, x, 1.f) != ref_code(map, x, 1.f);
    bad += quantize_code(map, 0.5f, 0.f) != ref_code(map, 0.f, 1.f);
  }
  const bool ok = bad == 0 && ties > 400;
  std::printf("%-48s %d ties, %d mismatches %s\n", "8-bit codes: nearest, lower on a tie", ties,
              bad, ok ? "ok" : "FAIL");
  failures += !ok;
}

// 8-bit AdamW (adamw8bit_*): three steps on 4 full quantization blocks and a partial one, with
// an inf and a NaN gradient in block 2 and an all-zero gradient in block 3, against a plain
// per-block reference that finds each code by a linear scan (the kernel searches) and updates
// each element as the Rust host update does. Codes, block maxima and masters must match
// exactly: the kernel's arithmetic is the host's, operation for operation.
template <typename G, typename P>
static void adamw8bit_case(const std::string& ty,
                           void (*kernel)(float*, unsigned char*, unsigned char*, float*, float*,
                                          const G*, P*, const float*, long long, float, float,
                                          float, float, float, float, float, float, float, int,
                                          unsigned long long)) {
  const int n = 4 * 256 + 77, blocks = 5;
  const auto maps = test_maps();
  const auto code = ref_code;
  auto master = rnd(n, 40);
  std::vector<float> want = master, mmax(blocks), vmax(blocks), wmmax(blocks), wvmax(blocks);
  std::vector<unsigned char> mq(n), vq(n), wmq(n), wvq(n);
  std::vector<P> model(n);
  // The constants as the Rust side derives them: in f64, then rounded to f32.
  const double lr = 1e-2, b1d = 0.9, b2d = 0.999, wd = 0.01;
  const float b1 = (float)b1d, b2 = (float)b2d, c1 = (float)(1 - b1d), c2 = (float)(1 - b2d),
              eps = 1e-8f, decay = (float)(1 - lr * wd), gm = 0.37f;
  bool same = true;
  for (int t = 1; t <= 3; t++) {
    auto g32 = rnd(n, 40 + t);
    g32[2 * 256 + 5] = INFINITY;
    g32[2 * 256 + 9] = NAN;
    for (int i = 3 * 256; i < 4 * 256; i++) g32[i] = 0.f;
    auto g = to<G>(g32);
    auto gf = back(g);
    const float step = (float)(lr / (1 - std::pow(b1d, t))),
                inv_bc2 = (float)(1 / std::sqrt(1 - std::pow(b2d, t)));
    const int first = t == 1;
    launch({(unsigned)blocks}, {256}, [&] {
      kernel(master.data(), mq.data(), vq.data(), mmax.data(), vmax.data(), g.data(),
             std::is_same_v<P, float> ? nullptr : model.data(), maps.data(), n, decay, b1, b2,
             c1, c2, eps, step, inv_bc2, gm, first, 0);
    });
    for (int b = 0; b < blocks; b++) {
      const int lo = b * 256, hi = std::min(n, lo + 256);
      std::vector<float> m(hi - lo), v(hi - lo);
      float am = 0.f, av = 0.f;
      for (int i = lo; i < hi; i++) {
        float mi = first ? 0.f : maps[wmq[i]] * wmmax[b];
        float vi = first ? 0.f : maps[256 + wvq[i]] * wvmax[b];
        // memory/src/host_adamw.rs `element`, operation for operation (`affine` = x * a + 0).
        auto affine = [](float x, float a) { return x * a + 0.f; };
        const float gi = affine(gf[i], gm);
        mi = first ? affine(gi, c1) : affine(mi, b1) + affine(gi, c1);
        vi = first ? affine(gi * gi, c2) : affine(vi, b2) + affine(gi * gi, c2);
        const float denom = affine(std::sqrt(vi), inv_bc2) + eps;
        want[i] = affine(want[i], decay) - affine(mi / denom, step);
        m[i - lo] = mi;
        v[i - lo] = vi;
        if (std::isfinite(mi)) am = std::max(am, std::fabs(mi));
        if (std::isfinite(vi)) av = std::max(av, std::fabs(vi));
      }
      wmmax[b] = am;
      wvmax[b] = av;
      for (int i = lo; i < hi; i++) {
        wmq[i] = code(maps.data(), m[i - lo], am);
        wvq[i] = code(maps.data() + 256, v[i - lo], av);
      }
    }
    auto bits_eq = [](float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); };
    for (int i = 0; i < n; i++) same &= mq[i] == wmq[i] && vq[i] == wvq[i] && bits_eq(master[i], want[i]);
    for (int b = 0; b < blocks; b++) same &= mmax[b] == wmmax[b] && vmax[b] == wvmax[b];
    if constexpr (!std::is_same_v<P, float>) {
      auto mf = back(model);
      for (int i = 0; i < n; i++) same &= bits_eq(mf[i], back(to<P>({master[i]}))[0]);
    }
  }
  // What the blocks must show: the inf stays an extreme code, the NaN the zero code, the zero
  // block keeps a zero maximum, and the finite elements of block 2 stay finite.
  const unsigned char zero = code(maps.data(), 0.f, 1.f);
  bool shape = mq[2 * 256 + 5] == 255 && vq[2 * 256 + 5] == 255 && mq[2 * 256 + 9] == zero &&
               mmax[3] == 0.f && vmax[3] == 0.f && mmax[2] > 0.f;
  for (int i = 2 * 256; i < 3 * 256; i++)
    if (i != 2 * 256 + 5 && i != 2 * 256 + 9) shape &= std::isfinite(master[i]);
  const bool ok = same && shape;
  std::printf("%-48s %s\n", ("adamw 8-bit, 3 steps, " + ty).c_str(), ok ? "ok" : "FAIL");
  failures += !ok;
}

// AdamW without masters (`--full-bf16`): a null master pointer, the bf16 weight read, updated and
// written back stochastically in place, two steps; against the host `element` port and the
// stochastic rounding of the same seed, bit for bit. With seed 0 it rounds to nearest.
static void adamw_in_place_case() {
  const int n = 600;
  auto w = to<bf16>(rnd(n, 60));
  std::vector<float> m(n), v(n), want_m(n), want_v(n);
  auto want = back(w);
  const double lr = 1e-2, b1d = 0.9, b2d = 0.999, wd = 0.01;
  const float b1 = (float)b1d, b2 = (float)b2d, c1 = (float)(1 - b1d), c2 = (float)(1 - b2d),
              eps = 1e-8f, decay = (float)(1 - lr * wd);
  auto affine = [](float x, float a) { return x * a + 0.f; };
  bool same = true;
  for (int t = 1; t <= 2; t++) {
    const auto g = to<bf16>(rnd(n, 60 + t));
    const auto gf = back(g);
    const float step = (float)(lr / (1 - std::pow(b1d, t))),
                inv_bc2 = (float)(1 / std::sqrt(1 - std::pow(b2d, t)));
    const unsigned long long seed = t == 1 ? 12345 : 0;
    launch({3}, {256}, [&] {
      adamw_bf16_bf16(nullptr, m.data(), v.data(), g.data(), w.data(), n, decay, b1, b2, c1, c2,
                      eps, step, inv_bc2, 1.f, t == 1, seed);
    });
    for (int i = 0; i < n; i++) {
      const float gi = gf[i];
      want_m[i] = t == 1 ? affine(gi, c1) : affine(want_m[i], b1) + affine(gi, c1);
      want_v[i] = t == 1 ? affine(gi * gi, c2) : affine(want_v[i], b2) + affine(gi * gi, c2);
      const float denom = affine(std::sqrt(want_v[i]), inv_bc2) + eps;
      const float p = affine(want[i], decay) - affine(want_m[i] / denom, step);
      bf16 r;
      r.x = seed ? bf16_bits_stochastic(p, rand_bits(seed, i)) : bf16_bits(p);
      want[i] = back(std::vector<bf16>{r})[0];
    }
    const auto got = back(w);
    for (int i = 0; i < n; i++)
      same &= got[i] == want[i] && m[i] == want_m[i] && v[i] == want_v[i];
  }
  std::printf("%-48s %s\n", "adamw in place (no master), bf16", same ? "ok" : "FAIL");
  failures += !same;
}

// 8-bit AdamW without masters (`--full-bf16`): a step with a null master, reading and writing the
// bf16 weight in place, against the same step from an fp32 master holding the weight's values
// (set again before each step), with the same seed: weights, codes and maxima bit for bit.
static void adamw8bit_in_place_case() {
  const int n = 2 * 256 + 30, blocks = 3;
  const auto maps = test_maps();
  auto a = to<bf16>(rnd(n, 80));
  auto b = a;
  std::vector<unsigned char> mqa(n), vqa(n), mqb(n), vqb(n);
  std::vector<float> mma(blocks), vma(blocks), mmb(blocks), vmb(blocks);
  bool same = true;
  for (int t = 1; t <= 3; t++) {
    const auto g = to<bf16>(rnd(n, 80 + t));
    auto master = back(a);
    const float step = (float)(1e-2 / (1 - std::pow(0.9, t))),
                inv_bc2 = (float)(1 / std::sqrt(1 - std::pow(0.999, t)));
    const unsigned long long seed = 1000 + t;
    launch({(unsigned)blocks}, {256}, [&] {
      adamw8bit_bf16_bf16(master.data(), mqa.data(), vqa.data(), mma.data(), vma.data(),
                          g.data(), a.data(), maps.data(), n, (float)(1 - 1e-4), 0.9f, 0.999f,
                          0.1f, 0.001f, 1e-8f, step, inv_bc2, 1.f, t == 1, seed);
    });
    launch({(unsigned)blocks}, {256}, [&] {
      adamw8bit_bf16_bf16(nullptr, mqb.data(), vqb.data(), mmb.data(), vmb.data(), g.data(),
                          b.data(), maps.data(), n, (float)(1 - 1e-4), 0.9f, 0.999f, 0.1f,
                          0.001f, 1e-8f, step, inv_bc2, 1.f, t == 1, seed);
    });
    same &= back(a) == back(b) && mqa == mqb && vqa == vqb && mma == mmb && vma == vmb;
  }
  std::printf("%-48s %s\n", "adamw 8-bit in place (no master), bf16", same ? "ok" : "FAIL");
  failures += !same;
}

// Stochastic rounding (standalone and inside AdamW): each result is one of the two bf16
// neighbours of the fp32 value, exact values stay exact, and the mean is unbiased.
static void stochastic_case() {
  const int n = 4096;
  const float v = 1.0f + std::ldexp(1.0f, -9);  // a quarter of the way from 1 to 1 + 2^-7
  std::vector<float> x(n, v);
  x[0] = 1.5f;
  std::vector<bf16> y(n);
  launch({3}, {256}, [&] { round_stochastic_bf16(x.data(), y.data(), n, 77); });
  auto yf = back(y);
  double mean = 0;
  bool neighbours = yf[0] == 1.5f;
  for (int i = 1; i < n; i++) {
    neighbours &= yf[i] == 1.0f || yf[i] == 1.0f + std::ldexp(1.0f, -7);
    mean += yf[i];
  }
  mean /= n - 1;
  const bool ok = neighbours && std::fabs(mean - v) < 4e-4;
  std::printf("%-48s mean %.6f vs %.6f %s\n", "stochastic rounding", mean, v, ok ? "ok" : "FAIL");
  failures += !ok;
  // AdamW with a seed: lr 0 leaves the master as is, so the weight is a neighbour of it.
  std::vector<float> master(n, v), m(n, 0.f), s2(n, 0.f);
  std::vector<bf16> g(n), w(n);
  launch({3}, {256}, [&] {
    adamw_bf16_bf16(master.data(), m.data(), s2.data(), g.data(), w.data(), n, 0.f, 0.9f, 0.999f,
                    0.1f, 0.001f, 1e-8f, 0.f, 1.f, 1.f, 1, 5);
  });
  auto wf = back(w);
  int up = 0;
  bool nb = true;
  for (int i = 0; i < n; i++) {
    nb &= wf[i] == 1.0f || wf[i] == 1.0f + std::ldexp(1.0f, -7);
    up += wf[i] != 1.0f;
  }
  const bool ok2 = nb && up > n / 8 && up < n * 3 / 8;
  std::printf("%-48s %d of %d up %s\n", "adamw stochastic bf16 write", up, n, ok2 ? "ok" : "FAIL");
  failures += !ok2;
}

// ---- Adafactor ------------------------------------------------------------------------------

// One Adafactor step as kernels/src/cuda/adafactor.rs launches it (geometry shrunk so grid-stride
// loops wrap: at most 3 blocks for element kernels), for a tensor viewed as [B, R, C] (`full`:
// n = B R C values with a full second moment in `row`). `parts_grid` > 0 instead gives the sum
// of squares that many 32-thread blocks and the update 3 blocks of 64 threads, so each of its
// blocks adds more partials than it has threads.
template <typename G, typename P>
static void adafactor_launch(float* master, const G* g, P* model, float* row, float* col,
                             int B, int R, int C, bool full, int chunk, float gm, float eps1,
                             float b2t, float lr, float wd, float clip, unsigned long long seed,
                             void (*rows_k)(const G*, float*, long long, int, int,
                                            ADAFACTOR_ARGS),
                             void (*parts_k)(const G*, float*, float*, long long, int, int, int,
                                             int, ADAFACTOR_ARGS),
                             void (*sumsq_k)(const G*, float*, const float*, const float*,
                                             float*, long long, int, int, ADAFACTOR_ARGS),
                             void (*apply_k)(float*, const G*, P*, const float*, const float*,
                                             const float*, const float*, int, long long, int,
                                             int, ADAFACTOR_ARGS, unsigned long long),
                             unsigned parts_grid = 0) {
  const long long n = (long long)B * R * C;
  const int r = full ? 1 : R, c = full ? 1 : C;
  const float a[10] = {gm,
                       eps1,
                       b2t,
                       (float)(1.0 - (double)b2t),
                       (float)(1.0 / r),
                       (float)(1.0 / c),
                       lr,
                       wd != 0.f ? lr * -wd + 0.f : 0.f,
                       (float)(1.0 / std::sqrt((double)n)),
                       1.f / clip};
#define A10 a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9]
  std::vector<float> rmean(B), part;
  if (!full) {
    // A thread per row shorter than a warp, else a warp per row (8 to a block).
    const int rows_pt = C < 32, mean_pt = R < 32;
    const long long rows = (long long)B * R;
    launch({(unsigned)(rows_pt ? (rows + 255) / 256 : (rows + 7) / 8)}, {256},
           [&] { rows_k(g, row, rows, C, rows_pt, A10); });
    const int chunks = (R + chunk - 1) / chunk;
    const long long bc = (long long)B * C;
    part.assign(chunks > 1 ? bc * chunks : 0, NAN);
    float* pp = chunks > 1 ? part.data() : nullptr;
    launch({grid_for(bc * chunks)}, {256},
           [&] { parts_k(g, col, pp, bc, R, C, chunk, chunks, A10); });
    if (pp) launch({grid_for(bc)}, {256}, [&] { adafactor_cols(pp, col, bc, chunks, A10); });
    launch({(unsigned)(mean_pt ? (B + 255) / 256 : (B + 7) / 8)}, {256},
           [&] { adafactor_row_mean(row, rmean.data(), B, R, mean_pt, a[4]); });
  }
  const unsigned parts = parts_grid ? parts_grid : grid_for(n);
  std::vector<float> sums(parts, NAN);
  const float* rm = full ? nullptr : rmean.data();
  float* cl = full ? nullptr : col;
  launch({parts}, {parts_grid ? 32u : 256u},
         [&] { sumsq_k(g, row, rm, cl, sums.data(), n, r, c, A10); });
  launch({parts_grid ? 3u : parts}, {parts_grid ? 64u : 256u}, [&] {
    apply_k(master, g, model, row, rm, cl, sums.data(), (int)parts, n, r, c, A10, seed);
  });
#undef A10
}

// Three Adafactor steps (transformers' update, HF Trainer's settings) against a double
// reference: the second moment (factored over [B, R, C], or full) and each step's update of the
// fp32 master; the bf16 model weight is the rounded master. `clip` small enough that the RMS
// clip acts.
template <typename G>
static void adafactor_case(const std::string& ty, int B, int R, int C, bool full, int chunk,
                           float clip,
                           void (*rows_k)(const G*, float*, long long, int, int, ADAFACTOR_ARGS),
                           void (*parts_k)(const G*, float*, float*, long long, int, int, int,
                                           int, ADAFACTOR_ARGS),
                           void (*sumsq_k)(const G*, float*, const float*, const float*, float*,
                                           long long, int, int, ADAFACTOR_ARGS),
                           void (*apply_k)(float*, const G*, bf16*, const float*, const float*,
                                           const float*, const float*, int, long long, int, int,
                                           ADAFACTOR_ARGS, unsigned long long),
                           unsigned parts_grid = 0) {
  const long long n = (long long)B * R * C;
  auto master = rnd(n, 90);
  std::vector<bf16> model(n);
  std::vector<float> row(full ? n : (long long)B * R, 0.f), col(full ? 0 : (long long)B * C, 0.f);
  std::vector<double> wm(master.begin(), master.end());
  std::vector<double> wrow(row.size(), 0.0), wcol(col.size(), 0.0);
  const float lr = 1e-2f, wd = 0.1f, gm = 0.5f, eps1 = 1e-30f;
  const std::string name = ty + " adafactor " +
                           (full ? "full " + std::to_string(n)
                                 : std::to_string(B) + "x" + std::to_string(R) + "x" +
                                       std::to_string(C) + " chunk " + std::to_string(chunk)) +
                           (parts_grid ? ", " + std::to_string(parts_grid) + " partials" : "");
  for (int t = 1; t <= 3; t++) {
    const auto g = to<G>(rnd(n, 90 + t));
    const auto gf = back(g);
    const float b2t = (float)(1.0 - std::pow((double)t, -0.8));
    const double b2 = b2t, c2 = 1.0 - b2;
    std::vector<double> u(n), gs(n);
    for (long long i = 0; i < n; i++) gs[i] = (double)gf[i] * gm;
    auto sq = [&](int b, int r, int c) {
      const double x = gs[((long long)b * R + r) * C + c];
      return x * x + eps1;
    };
    if (full) {
      for (long long i = 0; i < n; i++) {
        wrow[i] = b2 * wrow[i] + c2 * (gs[i] * gs[i] + eps1);
        u[i] = gs[i] / std::sqrt(wrow[i]);
      }
    } else {
      for (int b = 0; b < B; b++) {
        for (int r = 0; r < R; r++) {
          double s = 0;
          for (int c = 0; c < C; c++) s += sq(b, r, c);
          wrow[b * R + r] = b2 * wrow[b * R + r] + c2 * s / C;
        }
        for (int c = 0; c < C; c++) {
          double s = 0;
          for (int r = 0; r < R; r++) s += sq(b, r, c);
          wcol[b * C + c] = b2 * wcol[b * C + c] + c2 * s / R;
        }
        double rm = 0;
        for (int r = 0; r < R; r++) rm += wrow[b * R + r] / R;
        for (int r = 0; r < R; r++)
          for (int c = 0; c < C; c++) {
            const long long i = ((long long)b * R + r) * C + c;
            u[i] = gs[i] / std::sqrt(wrow[b * R + r] / rm * wcol[b * C + c]);
          }
      }
    }
    double ss = 0;
    for (double x : u) ss += x * x;
    const double denom = std::max(1.0, std::sqrt(ss / n) / clip);
    std::vector<double> want_step(n);
    const auto before = master;
    for (long long i = 0; i < n; i++) {
      const double p = wm[i] * (1.0 - (double)lr * wd) - (double)lr * u[i] / denom;
      want_step[i] = p - before[i];
      wm[i] = p;
    }
    adafactor_launch<G, bf16>(master.data(), g.data(), model.data(), row.data(), col.data(), B,
                              R, C, full, chunk, gm, eps1, b2t, lr, wd, clip, 0, rows_k,
                              parts_k, sumsq_k, apply_k, parts_grid);
    std::vector<float> got_step(n);
    for (long long i = 0; i < n; i++) got_step[i] = master[i] - before[i];
    const std::string s = name + " step " + std::to_string(t);
    check(s + (full ? " v" : " row"), row, wrow, 1e-5);
    if (!full) check(s + " col", col, wcol, 1e-5);
    check(s + " update", got_step, want_step, 2e-4);
    std::vector<double> rounded(n);
    for (long long i = 0; i < n; i++) rounded[i] = back(to<bf16>({master[i]}))[0];
    check(s + " bf16 weight = rounded master", back(model), rounded, 0);
  }
}

// Adafactor without masters (`--full-bf16`): the bf16 weight read, updated and written back
// stochastically in place, against the same step from an fp32 master holding the weight's
// values, writing the bf16 weight with the same seed: weights and state bit for bit, 3 steps.
static void adafactor_in_place_case() {
  const int B = 3, R = 5, C = 40;
  const long long n = (long long)B * R * C;
  auto a = to<bf16>(rnd(n, 70));
  auto b = a;
  std::vector<float> rowa(B * R), cola(B * C), rowb(B * R), colb(B * C);
  bool same = true;
  for (int t = 1; t <= 3; t++) {
    const auto g = to<bf16>(rnd(n, 70 + t));
    auto master = back(a);
    const float b2t = (float)(1.0 - std::pow((double)t, -0.8));
    const unsigned long long seed = 500 + t;
    adafactor_launch<bf16, bf16>(master.data(), g.data(), a.data(), rowa.data(), cola.data(), B,
                                 R, C, false, 2, 0.25f, 1e-30f, b2t, 1e-2f, 0.01f, 1.f, seed,
                                 adafactor_rows_bf16, adafactor_col_parts_bf16,
                                 adafactor_sumsq_bf16, adafactor_apply_bf16_bf16);
    adafactor_launch<bf16, bf16>(nullptr, g.data(), b.data(), rowb.data(), colb.data(), B, R, C,
                                 false, 2, 0.25f, 1e-30f, b2t, 1e-2f, 0.01f, 1.f, seed,
                                 adafactor_rows_bf16, adafactor_col_parts_bf16,
                                 adafactor_sumsq_bf16, adafactor_apply_bf16_bf16);
    same &= back(a) == back(b) && rowa == rowb && cola == colb;
  }
  std::printf("%-48s %s\n", "adafactor in place (no master), bf16", same ? "ok" : "FAIL");
  failures += !same;
}

static void sum_squares_case() {
  auto a = rnd(1000, 30), b = rnd(77, 31);
  auto bb = to<bf16>(b);
  auto bf = back(bb);
  double acc = 0, want = 0;
  launch({3}, {256}, [&] { sum_squares_f32(a.data(), (long long)a.size(), &acc); });
  launch({1}, {256}, [&] { sum_squares_bf16(bb.data(), (long long)bb.size(), &acc); });
  for (float v : a) want += (double)v * v;
  for (float v : bf) want += (double)v * v;
  check("sum of squares (global norm)", {(float)acc}, {want}, 1e-6);
}

// Every thread of a block adds to one double at once, as the global-norm reduction's blocks do:
// the sum must come out exact (halves add exactly), whichever atomic the build uses.
static void atomic_add_f64_case() {
  double acc = 0;
  const int per_thread = 64;
  launch({1}, {256}, [&] {
    for (int i = 0; i < per_thread; i++) atomic_add_f64(&acc, 0.5);
  });
  const double want = 256.0 * per_thread * 0.5;
  const bool ok = acc == want;
  std::printf("%-48s %.1f of %.1f %s\n", "double atomic add, 256 threads at once", acc, want,
              ok ? "ok" : "FAIL");
  failures += !ok;
}

static void unscale_case() {
  std::vector<f16> g = to<f16>({2.f, -4.f, 8.f, 0.5f});
  std::vector<float> out(4);
  int found = 0;
  launch({1}, {64}, [&] { unscale_f16(g.data(), out.data(), 4, 0.5f, &found); });
  check("unscale f16 values", out, {1, -2, 4, 0.25}, 0);
  if (found) {
    std::printf("unscale flagged finite gradients FAIL\n");
    failures++;
  }
  std::vector<float> bad = {1.f, INFINITY, 3.f};
  launch({1}, {64}, [&] { unscale_f32(bad.data(), out.data(), 3, 1.f, &found); });
  std::printf("%-48s %s\n", "unscale finds inf", found ? "ok" : "FAIL");
  failures += !found;
}

int main(int argc, char** argv) {
  // A warp-level call that not every lane reaches (a shuffle behind a divergent branch) waits
  // forever at the emulated warp barrier: end the run with SIGALRM instead of hanging CI.
  alarm(600);
  // `atomics`: only the kernels built on the double atomic add, for the build that takes the
  // compare-and-swap fallback of GPUs below sm_60 (-D__CUDA_ARCH__=520).
  if (argc > 1 && std::string(argv[1]) == "atomics") {
    atomic_add_f64_case();
    sum_squares_case();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 600
    const bool raced = cas_retries > 0;
    std::printf("%-48s %lld retries %s\n", "compare-and-swap loop retried under contention",
                (long long)cas_retries, raced ? "ok" : "FAIL");
    failures += !raced;
#endif
    std::printf("%d failure(s)\n", failures);
    return failures ? 1 : 0;
  }
  for (int log_ = 0; log_ <= 1; log_++) {
    softmax_case<float>("f32", 5, 8, log_, 1e-5, softmax_fwd_f32, softmax_bwd_f32);
    softmax_case<float>("f32", 5, 37, log_, 1e-5, softmax_fwd_f32, softmax_bwd_f32);
    softmax_case<float>("f32", 3, 700, log_, 1e-5, softmax_fwd_f32, softmax_bwd_f32);
    softmax_case<bf16>("bf16", 4, 300, log_, 1e-2, softmax_fwd_bf16, softmax_bwd_bf16);
  }
  for (int center = 0; center <= 1; center++) {
    norm_case<float>("f32", 6, 48, center, 1e-5, norm_fwd_f32, norm_bwd_f32);
    norm_case<float>("f32", 2, 1500, center, 1e-5, norm_fwd_f32, norm_bwd_f32);
    norm_case<f16>("f16", 3, 96, center, 2e-3, norm_fwd_f16, norm_bwd_f16);
  }
  upsample_case();
  pool_case(3, 3, 2, 2, 0, 11, 9);
  pool_case(2, 2, 2, 2, 1, 10, 7);
  pool_case(2, 3, 1, 1, 0, 6, 7);
  const AttnCase cases[] = {{2, 3, 130, 130, 0.125f, 0, false},
                            {2, 2, 70, 77, 1.0f, 1, false},
                            {2, 2, 40, 40, 0.125f, 2, false},
                            {2, 1, 33, 65, 0.125f, 2, true}};
  for (const auto& c : cases)
    attention_case<float>("f32", c, 1e-5, attn_fwd_f32, attn_delta_f32, attn_bwd_q_f32,
                          attn_bwd_kv_f32);
  attention_case<bf16>("bf16", cases[1], 1e-2, attn_fwd_bf16, attn_delta_bf16, attn_bwd_q_bf16,
                       attn_bwd_kv_bf16);
  // The tensor-core kernels (4 warps per 64 rows): the forward with the CUDA-core backward,
  // then all of them together.
  for (const auto& c : cases)
    attention_case<bf16>("bf16 tc forward", c, 1e-2, attn_fwd_tc_bf16, attn_delta_bf16,
                         attn_bwd_q_bf16, attn_bwd_kv_bf16, 128);
  for (const auto& c : cases)
    attention_case<bf16>("bf16 tc fwd+bwd", c, 1e-2, attn_fwd_tc_bf16, attn_delta_bf16,
                         attn_bwd_q_tc_bf16, attn_bwd_kv_tc_bf16, 128);
  adamw_case();
  adamw_in_place_case();
  adamw8bit_in_place_case();
  quantize_codes_case();
  adamw8bit_case<bf16, bf16>("bf16 gradient, bf16 weight", adamw8bit_bf16_bf16);
  adamw8bit_case<float, float>("f32 gradient, masters only", adamw8bit_f32_f32);
  adafactor_case<float>("f32", 2, 37, 45, false, 32, 0.5f, adafactor_rows_f32,
                        adafactor_col_parts_f32, adafactor_sumsq_f32, adafactor_apply_f32_bf16);
  adafactor_case<bf16>("bf16", 2, 37, 45, false, 4, 1.f, adafactor_rows_bf16,
                       adafactor_col_parts_bf16, adafactor_sumsq_bf16, adafactor_apply_bf16_bf16);
  // A 3x3 convolution: [out, in, 3, 3] factored over its kernel dims, one chunk.
  adafactor_case<bf16>("bf16", 40, 3, 3, false, 32, 1.f, adafactor_rows_bf16,
                       adafactor_col_parts_bf16, adafactor_sumsq_bf16, adafactor_apply_bf16_bf16);
  adafactor_case<float>("f32", 1, 1, 777, true, 32, 0.5f, adafactor_rows_f32,
                        adafactor_col_parts_f32, adafactor_sumsq_f32, adafactor_apply_f32_bf16);
  // Past 300 x 32 values, so that every one of the 300 partials holds some.
  adafactor_case<float>("f32", 1, 1, 10007, true, 32, 0.5f, adafactor_rows_f32,
                        adafactor_col_parts_f32, adafactor_sumsq_f32, adafactor_apply_f32_bf16,
                        300);
  adafactor_in_place_case();
  stochastic_case();
  sum_squares_case();
  atomic_add_f64_case();
  unscale_case();
  std::printf("%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
