// The gated feed-forward (gated.cu) against a double-precision reference: both forms (two
// tensors; the halves of one projection's rows), every activation, forward and both gradients,
// in f32, bf16 and f16 (the reference rounds where the two ops would: the activation, then the
// product; the product's gradient, then the activation's; within one last place, so a rounding
// left out would not show).
#pragma once

#include "common.h"

static double gated_ref_act(int act, double x) {
  switch (act) {
    case 0: return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
    case 1: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case 2: return x / (1 + std::exp(-x));
    default: return x > 0 ? x : 0;
  }
}

static double gated_ref_grad(int act, double x) {
  const double h = 1e-5;  // the derivative by central differences of the double reference
  if (act == 3) return x > 0 ? 1 : 0;
  return (gated_ref_act(act, x + h) - gated_ref_act(act, x - h)) / (2 * h);
}

// rows x width operands; `halves`: GEGLU's layout (value then gate in each 2-width row).
template <typename T, typename Fwd, typename Bwd>
static void gated_form(const char* dtype, bool halves, int act, double tol, Fwd fwd, Bwd bwd) {
  // More elements than the emulation's 3 blocks of 256 threads: the grid-stride loop wraps.
  const long long rows = 7, width = 193, n = rows * width;
  const long long in_stride = halves ? 2 * width : width;
  auto gate_f = rnd(n, 31 + act), value_f = rnd(n, 37 + act), g_f = rnd(n, 41 + act);
  for (auto& v : gate_f) v *= 4.f;
  // T5's form: two buffers; GEGLU's: one buffer of 2-width rows.
  std::vector<float> h_f(halves ? 2 * n : 0);
  for (long long r = 0; halves && r < rows; r++)
    for (long long j = 0; j < width; j++) {
      h_f[r * in_stride + j] = value_f[r * width + j];
      h_f[r * in_stride + width + j] = gate_f[r * width + j];
    }
  auto gate_t = to<T>(halves ? h_f : gate_f), value_t = to<T>(halves ? h_f : value_f);
  auto g_t = to<T>(g_f);
  const T* gate_p = gate_t.data() + (halves ? width : 0);
  const T* value_p = value_t.data();
  auto gate = back(to<T>(gate_f)), value = back(to<T>(value_f)), g = back(g_t);
  const bool narrow = sizeof(T) == 2;
  auto round = [&](double v) { return narrow ? (double)back(to<T>({(float)v}))[0] : v; };
  std::vector<T> y(n), grads(2 * n);
  launch({grid_for(n)}, {256}, [&] { fwd(gate_p, value_p, y.data(), n, width, in_stride, act); });
  // Gradients: T5's stacked [2, n] (gate then value), GEGLU's the projection's rows.
  T* d_gate = grads.data() + (halves ? width : 0);
  T* d_value = grads.data() + (halves ? 0 : n);
  launch({grid_for(n)}, {256}, [&] {
    bwd(g_t.data(), gate_p, value_p, d_gate, d_value, n, width, in_stride, in_stride, act);
  });
  std::vector<double> want_y(n), want_dg(n), want_dv(n);
  std::vector<float> got_dg(n), got_dv(n);
  auto all = back(grads);
  for (long long i = 0; i < n; i++) {
    const double a = gate[i], v = value[i], gi = g[i];
    want_y[i] = round(round(gated_ref_act(act, a)) * v);
    want_dv[i] = round(gi * round(gated_ref_act(act, a)));
    want_dg[i] = round(round(gi * v) * gated_ref_grad(act, a));
    const long long r = i / width, j = i % width;
    got_dg[i] = halves ? all[r * in_stride + width + j] : all[i];
    got_dv[i] = halves ? all[r * in_stride + j] : all[n + i];
  }
  const std::string name = std::string(dtype) + (halves ? " gated halves" : " gated") + " act " +
                           std::to_string(act);
  check(name + " forward", back(y), want_y, tol);
  check(name + " d value", got_dv, want_dv, tol);
  check(name + " d gate", got_dg, want_dg, tol);
}

static void gated_case() {
  for (int act = 0; act < 4; act++)
    for (bool halves : {false, true}) {
      gated_form<float>("f32", halves, act, 2e-6, gated_fwd_f32, gated_bwd_f32);
      // bf16: one last place (2^-8) where the float and the double reference round apart.
      gated_form<bf16>("bf16", halves, act, 8e-3, gated_fwd_bf16, gated_bwd_bf16);
      gated_form<f16>("f16", halves, act, 1e-3, gated_fwd_f16, gated_bwd_f16);
    }
}
