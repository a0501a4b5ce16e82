// A norm with its affine part and activation (norm_affine.cu), forward, against a double
// reference that rounds where the kernel rounds (the normalised value, the product, the sum):
// group norm with SiLU and with none, with and without a bias; layer norm with weight and
// bias; RMS norm with a weight; in f32, bf16 and f16, rows longer than a block.
#pragma once

#include "common.h"

// `shape` [n, c, inner] in `groups` groups (1 group and inner 1: a norm over rows of c).
template <typename T, typename Fwd>
static void norm_affine_form(const char* dtype, const char* what, int n, int c, int inner,
                             int groups, int center, bool has_b, int act, double tol, Fwd fwd) {
  const float eps = 1e-5f;
  const int per_group = c / groups, cols = per_group * inner, rows = n * groups;
  const size_t len = (size_t)rows * cols;
  auto xf = rnd(len, 51 + c);
  for (auto& v : xf) v = 3.f * v + 0.5f;
  auto wf = rnd((size_t)c, 53 + c), bf = rnd((size_t)c, 57 + c);
  for (auto& v : wf) v += 1.f;
  auto x_t = to<T>(xf), w_t = to<T>(wf), b_t = to<T>(bf);
  auto x = back(x_t), w = back(w_t), b = back(b_t);
  const bool narrow = sizeof(T) == 2;
  auto round = [&](double v) { return narrow ? (double)back(to<T>({(float)v}))[0] : v; };
  std::vector<T> y(len);
  launch({(unsigned)rows}, {row_block(cols)}, [&] {
    fwd(x_t.data(), w_t.data(), has_b ? b_t.data() : nullptr, y.data(), cols, groups, per_group,
        inner, eps, center, act);
  });
  std::vector<double> want(len);
  for (int r = 0; r < rows; r++) {
    const float* xr = &x[(size_t)r * cols];
    double mean = 0, var = 0;
    if (center) {
      for (int j = 0; j < cols; j++) mean += xr[j];
      mean /= cols;
    }
    for (int j = 0; j < cols; j++) var += (xr[j] - mean) * (xr[j] - mean);
    var /= cols;
    const double rs = 1.0 / std::sqrt(var + eps);
    for (int j = 0; j < cols; j++) {
      const int ch = (r % groups) * per_group + j / inner;
      double z = round(round((xr[j] - mean) * rs) * w[ch]);
      if (has_b) z = round(z + b[ch]);
      want[(size_t)r * cols + j] = act >= 0 ? gated_ref_act(act, z) : z;
    }
  }
  const std::string name = std::string(dtype) + " norm_affine " + what + (has_b ? "" : " no bias") +
                           (act >= 0 ? " act " + std::to_string(act) : "");
  check(name, back(y), want, tol);
}

template <typename T, typename Fwd>
static void norm_affine_dtype(const char* dtype, double tol, Fwd fwd) {
  for (bool has_b : {true, false})
    for (int act : {-1, 2}) norm_affine_form<T>(dtype, "group", 2, 12, 45, 3, 1, has_b, act, tol, fwd);
  // Rows of 640 values, more than a block's 512 threads.
  norm_affine_form<T>(dtype, "group", 1, 8, 160, 2, 1, true, 2, tol, fwd);
  norm_affine_form<T>(dtype, "layer", 5, 96, 1, 1, 1, true, -1, tol, fwd);
  norm_affine_form<T>(dtype, "rms", 4, 700, 1, 1, 0, false, -1, tol, fwd);
}

static void norm_affine_case() {
  norm_affine_dtype<float>("f32", 1e-5, norm_affine_fwd_f32);
  // bf16/f16: a last place where the float statistics and the double reference round apart.
  norm_affine_dtype<bf16>("bf16", 8e-3, norm_affine_fwd_bf16);
  norm_affine_dtype<f16>("f16", 2e-3, norm_affine_fwd_f16);
}
