// Softmax and log-softmax (softmax.cu) against a double reference.
#pragma once

#include "common.h"

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
