// Stochastic rounding (rounding.cu, and inside the AdamW kernel).
#pragma once

#include "common.h"

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
