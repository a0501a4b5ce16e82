// Max and average pooling (pool.cu) against a double reference.
#pragma once

#include "common.h"

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
