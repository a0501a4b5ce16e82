// Sums of squares, the double atomic add and the f16 unscale (grad_norm.cu).
#pragma once

#include "common.h"

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
