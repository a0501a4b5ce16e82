// Dropout (dropout.cu) against a sequential splitmix64 draw, the generator the masks are
// defined by: u = (next >> 11) / 2^53 kept when below 1 - p, the stream `skip` outputs on.
#pragma once

#include "common.h"

static void dropout_case() {
  const long long n = 5000;
  const unsigned long long seed = 0x1234abcdull, skip = 777;
  const double p = 0.3;
  const unsigned long long threshold = (unsigned long long)std::ceil((1.0 - p) * 9007199254740992.0);
  const float scale = (float)(1.0 / (1.0 - p));
  auto x = rnd(n, 9);
  std::vector<float> y(n);
  launch({grid_for(n)}, {256}, [&] { dropout_f32(x.data(), y.data(), n, seed, skip, threshold, scale); });
  std::vector<double> want(n);
  unsigned long long state = seed + skip * 0x9E3779B97F4A7C15ull;
  long long kept = 0;
  std::vector<bool> keeps(n);
  for (long long i = 0; i < n; i++) {
    state += 0x9E3779B97F4A7C15ull;
    unsigned long long z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const bool keep = (double)(z >> 11) / 9007199254740992.0 < 1.0 - p;
    kept += keep;
    keeps[i] = keep;
    want[i] = x[i] * (keep ? scale : 0.f);
  }
  check("f32 dropout", y, want, 0);
  const bool rate = std::fabs((double)kept / n - (1.0 - p)) < 0.03;
  std::printf("%-48s kept %.3f of %.3f %s\n", "dropout keep rate", (double)kept / n, 1.0 - p,
              rate ? "ok" : "FAIL");
  failures += !rate;
  // bf16: the product of the bf16 input and the bf16 scale, rounded once to bf16.
  auto xb = to<bf16>(x);
  std::vector<bf16> yb(n);
  const float sb = back(to<bf16>(std::vector<float>{scale}))[0];
  launch({grid_for(n)}, {256}, [&] { dropout_bf16(xb.data(), yb.data(), n, seed, skip, threshold, sb); });
  auto xf = back(xb);
  std::vector<double> wantb(n);
  std::vector<float> prod(n);
  for (long long i = 0; i < n; i++) prod[i] = xf[i] * (keeps[i] ? sb : 0.f);
  auto rounded = back(to<bf16>(prod));
  for (long long i = 0; i < n; i++) wantb[i] = rounded[i];
  check("bf16 dropout", back(yb), wantb, 0);
}
