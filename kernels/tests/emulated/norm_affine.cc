// A norm with its affine part and activation (norm_affine.cu), forward and backward, against
// a double reference that rounds where the kernel rounds (the normalised value, the product,
// the sum): group norm with each activation and with none, with and without a bias; layer
// norm with weight and bias; RMS norm with a weight; in f32, bf16 and f16, rows longer than a
// block. The backward's reference: dz = act'(z) g, d = w dz, dx = r (d - mean(d) - xe
// mean(d xe)), dw = sum(dz xhat), db = sum(dz).
#pragma once

#include "common.h"

// `shape` [n, c, inner] in `groups` groups (1 group and inner 1: a norm over rows of c).
template <typename T, typename Fwd, typename BwdX, typename BwdP>
static void norm_affine_form(const char* dtype, const char* what, int n, int c, int inner,
                             int groups, int center, bool has_b, int act, double tol, Fwd fwd,
                             BwdX bwd_x, BwdP bwd_p) {
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
  auto gf = rnd(len, 59 + c);
  auto g_t = to<T>(gf);
  auto gv = back(g_t);
  std::vector<T> dx(len);
  std::vector<float> stats(2 * (size_t)rows), dw(c), db(c);
  launch({(unsigned)rows}, {row_block(cols)}, [&] {
    bwd_x(x_t.data(), g_t.data(), w_t.data(), has_b ? b_t.data() : nullptr, dx.data(),
          stats.data(), cols, groups, per_group, inner, eps, center, act);
  });
  launch({(unsigned)c}, {256}, [&] {
    bwd_p(x_t.data(), g_t.data(), w_t.data(), has_b ? b_t.data() : nullptr, stats.data(),
          dw.data(), has_b ? db.data() : nullptr, rows, cols, groups, per_group, inner, act);
  });
  std::vector<double> want(len), want_dx(len), want_dw(c, 0.0), want_db(c, 0.0);
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
    std::vector<double> d(cols);
    double s1 = 0, s2 = 0;
    for (int j = 0; j < cols; j++) {
      const int ch = (r % groups) * per_group + j / inner;
      const double xe = (xr[j] - mean) * rs, xhat = round(xe);
      double z = round(xhat * w[ch]);
      if (has_b) z = round(z + b[ch]);
      want[(size_t)r * cols + j] = act >= 0 ? gated_ref_act(act, z) : z;
      const double gj = gv[(size_t)r * cols + j];
      const double dz = act >= 0 ? gj * gated_ref_grad(act, z) : gj;
      want_dw[ch] += dz * xhat;
      want_db[ch] += dz;
      d[j] = dz * w[ch];
      s1 += d[j];
      s2 += d[j] * xe;
    }
    s1 = center ? s1 / cols : 0;
    s2 /= cols;
    for (int j = 0; j < cols; j++)
      want_dx[(size_t)r * cols + j] = rs * (d[j] - s1 - (xr[j] - mean) * rs * s2);
  }
  const std::string name = std::string(dtype) + " norm_affine " + what + (has_b ? "" : " no bias") +
                           (act >= 0 ? " act " + std::to_string(act) : "");
  check(name, back(y), want, tol);
  // The gradients: sums over a row or a channel, so a few units of the dtype's rounding.
  check(name + " dx", back(dx), want_dx, 4 * tol);
  // dw and db are f32 sums of values the reference rounds as the kernel does: tight in every
  // dtype (a rounded x-hat swapped for the unrounded one would show in bf16 and f16).
  check(name + " dw", dw, want_dw, 1e-4);
  if (has_b) check(name + " db", db, want_db, 1e-4);
}

template <typename T, typename... K>
static void norm_affine_dtype(const char* dtype, double tol, K... k) {
  // Every activation in f32; none and SiLU (what the models use) in bf16 and f16.
  const bool wide = sizeof(T) == 4;
  for (bool has_b : {true, false})
    for (int act : {-1, 0, 1, 2, 3})
      if (wide || act == -1 || act == 2)
        norm_affine_form<T>(dtype, "group", 2, 12, 45, 3, 1, has_b, act, tol, k...);
  // Rows of 640 values, more than a block's 512 threads.
  norm_affine_form<T>(dtype, "group", 1, 8, 160, 2, 1, true, 2, tol, k...);
  norm_affine_form<T>(dtype, "layer", 5, 96, 1, 1, 1, true, -1, tol, k...);
  // 300 rows: the parameters' kernel walks more values a channel than its 256 threads.
  norm_affine_form<T>(dtype, "layer, 300 rows", 300, 8, 1, 1, 1, true, 2, tol, k...);
  norm_affine_form<T>(dtype, "rms", 4, 700, 1, 1, 0, false, -1, tol, k...);
}

static void norm_affine_case() {
  norm_affine_dtype<float>("f32", 1e-5, norm_affine_fwd_f32, norm_affine_bwd_x_f32,
                           norm_affine_bwd_params_f32);
  // bf16/f16: a last place where the float statistics and the double reference round apart.
  norm_affine_dtype<bf16>("bf16", 8e-3, norm_affine_fwd_bf16, norm_affine_bwd_x_bf16,
                          norm_affine_bwd_params_bf16);
  norm_affine_dtype<f16>("f16", 2e-3, norm_affine_fwd_f16, norm_affine_bwd_x_f16,
                         norm_affine_bwd_params_f16);
}
