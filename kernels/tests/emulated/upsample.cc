// Nearest 2x upsampling (upsample.cu) against a double reference.
#pragma once

#include "common.h"

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
