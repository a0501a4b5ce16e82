// What every family's checks share: the failure count, seeded inputs, values rounded through a
// storage type, the relative-error check, and the launch geometry of the row and element
// kernels (element grids shrunk to 3 blocks so that grid-stride loops wrap).
#pragma once

#include <cstdio>
#include <string>
#include <vector>

static int failures = 0;

static std::vector<float> rnd(size_t n, unsigned long long seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++) {
    unsigned long long z = seed * 0x9E3779B97F4A7C15ull + (i + 1) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
    v[i] = (float)((double)(z >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
  }
  return v;
}

// Values rounded through T, as the kernel will see them.
template <typename T>
static std::vector<T> to(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); i++) st(out.data(), (long long)i, v[i]);
  return out;
}
template <typename T>
static std::vector<float> back(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); i++) out[i] = ld(v.data(), (long long)i);
  return out;
}

static void check(const std::string& name, const std::vector<float>& got,
                  const std::vector<double>& want, double tol) {
  double err = 0, scale = 1e-12;
  for (size_t i = 0; i < want.size(); i++) {
    err = std::max(err, std::fabs((double)got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  const bool bad = got.size() != want.size() || !(err / scale <= tol);
  std::printf("%-48s rel err %.2e %s\n", name.c_str(), err / scale, bad ? "FAIL" : "ok");
  failures += bad;
}

static unsigned row_block(int cols) {
  unsigned b = (unsigned)((cols + 31) / 32 * 32);
  return std::min(512u, std::max(32u, b));
}

static unsigned grid_for(long long n) { return (unsigned)std::min<long long>((n + 255) / 256, 3); }
