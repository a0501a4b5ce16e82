// Attention, CUDA-core and tensor-core kernels (attention.cu, attention_tc.cu), forward and
// backward, against a double reference.
#pragma once

#include "common.h"

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
