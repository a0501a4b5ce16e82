// Layer and RMS norm (norm.cu) against a double reference.
#pragma once

#include "common.h"

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
