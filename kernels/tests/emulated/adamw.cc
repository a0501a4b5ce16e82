// AdamW and 8-bit AdamW (adamw.cu) against the host update's arithmetic.
#pragma once

#include "common.h"

static void adamw_case() {
  const int n = 777;
  auto master = rnd(n, 20), m = rnd(n, 21), v = rnd(n, 22), g32 = rnd(n, 23);
  for (auto& x : v) x = std::fabs(x);
  auto g = to<bf16>(g32);
  auto gf = back(g);
  std::vector<bf16> model(n);
  for (int first = 1; first >= 0; first--) {
    const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01, gm = 0.5;
    const int t = first ? 1 : 5;
    const double step = lr / (1 - std::pow(b1, t)), bc2 = std::sqrt(1 - std::pow(b2, t));
    std::vector<double> wm(n), wv(n), wp(n), wmodel(n);
    for (int i = 0; i < n; i++) {
      const double gi = gf[i] * gm;
      const double mp = first ? 0 : m[i], vp = first ? 0 : v[i];
      wm[i] = b1 * mp + (1 - b1) * gi;
      wv[i] = b2 * vp + (1 - b2) * gi * gi;
      wp[i] = master[i] * (1 - lr * wd) - step * wm[i] / (std::sqrt(wv[i]) / bc2 + eps);
    }
    launch({2}, {256}, [&] {
      adamw_bf16_bf16(master.data(), m.data(), v.data(), g.data(), model.data(), n,
                      1 - lr * wd, b1, b2, 1 - b1, 1 - b2, eps, step, 1 / bc2, gm, first, 0);
    });
    for (int i = 0; i < n; i++) wmodel[i] = back(to<bf16>({master[i]}))[0];
    const std::string s = first ? "adamw first step" : "adamw later step";
    check(s + " exp_avg", m, wm, 1e-6);
    check(s + " exp_avg_sq", v, wv, 1e-6);
    check(s + " master", master, wp, 1e-6);
    check(s + " bf16 weight = rounded master", back(model), wmodel, 0);
  }
}

// Two ascending 256-value maps with 0 and 1 in them (signed, then unsigned), of dyadic values
// so that the midpoint of two neighbours is exact: a tie.
static std::vector<float> test_maps() {
  std::vector<float> maps(512);
  for (int k = 0; k < 256; k++) {
    const float s = (float)(k - 127) / 128.f, u = (float)k / 256.f;
    maps[k] = s * s * s;  // 0 at 127
    maps[256 + k] = k == 255 ? 1.f : u * u;
  }
  return maps;
}

// The 8-bit code of `x` in a block of maximum `max` by a linear scan: the nearest map value,
// the lowest index on a tie; NaN or a zero block gives the code of 0, an inf an extreme.
static unsigned char ref_code(const float* map, float x, float max) {
  x = (std::isnan(x) || max == 0.f) ? 0.f : std::clamp(x / max, -1.f, 1.f);
  int best = 0;
  for (int k = 1; k < 256; k++)
    if (std::fabs(x - map[k]) < std::fabs(x - map[best])) best = k;
  return (unsigned char)best;
}

// The kernel's code search against the scan on every map value, every midpoint (ties), points
// just beside them, and the out-of-range and non-finite inputs.
static void quantize_codes_case() {
  const auto maps = test_maps();
  int bad = 0, ties = 0;
  for (int which = 0; which < 2; which++) {
    const float* map = maps.data() + 256 * which;
    std::vector<float> xs = {0.f, -0.f, 2.f, -2.f, INFINITY, -INFINITY, NAN};
    for (int k = 0; k < 256; k++) {
      xs.push_back(map[k]);
      if (k == 255) continue;
      const float mid = (map[k] + map[k + 1]) / 2;
      ties += mid - map[k] == map[k + 1] - mid;
      xs.insert(xs.end(), {mid, std::nextafter(mid, -1.f), std::nextafter(mid, 2.f)});
    }
    for (float x : xs) bad += quantize_code(map, x, 1.f) != ref_code(map, x, 1.f);
    bad += quantize_code(map, 0.5f, 0.f) != ref_code(map, 0.f, 1.f);
  }
  const bool ok = bad == 0 && ties > 400;
  std::printf("%-48s %d ties, %d mismatches %s\n", "8-bit codes: nearest, lower on a tie", ties,
              bad, ok ? "ok" : "FAIL");
  failures += !ok;
}

// 8-bit AdamW (adamw8bit_*): three steps on 4 full quantization blocks and a partial one, with
// an inf and a NaN gradient in block 2 and an all-zero gradient in block 3, against a plain
// per-block reference that finds each code by a linear scan (the kernel searches) and updates
// each element as the Rust host update does. Codes, block maxima and masters must match
// exactly: the kernel's arithmetic is the host's, operation for operation.
template <typename G, typename P>
static void adamw8bit_case(const std::string& ty,
                           void (*kernel)(float*, unsigned char*, unsigned char*, float*, float*,
                                          const G*, P*, const float*, long long, float, float,
                                          float, float, float, float, float, float, float, int,
                                          unsigned long long)) {
  const int n = 4 * 256 + 77, blocks = 5;
  const auto maps = test_maps();
  const auto code = ref_code;
  auto master = rnd(n, 40);
  std::vector<float> want = master, mmax(blocks), vmax(blocks), wmmax(blocks), wvmax(blocks);
  std::vector<unsigned char> mq(n), vq(n), wmq(n), wvq(n);
  std::vector<P> model(n);
  // The constants as the Rust side derives them: in f64, then rounded to f32.
  const double lr = 1e-2, b1d = 0.9, b2d = 0.999, wd = 0.01;
  const float b1 = (float)b1d, b2 = (float)b2d, c1 = (float)(1 - b1d), c2 = (float)(1 - b2d),
              eps = 1e-8f, decay = (float)(1 - lr * wd), gm = 0.37f;
  bool same = true;
  for (int t = 1; t <= 3; t++) {
    auto g32 = rnd(n, 40 + t);
    g32[2 * 256 + 5] = INFINITY;
    g32[2 * 256 + 9] = NAN;
    for (int i = 3 * 256; i < 4 * 256; i++) g32[i] = 0.f;
    auto g = to<G>(g32);
    auto gf = back(g);
    const float step = (float)(lr / (1 - std::pow(b1d, t))),
                inv_bc2 = (float)(1 / std::sqrt(1 - std::pow(b2d, t)));
    const int first = t == 1;
    launch({(unsigned)blocks}, {256}, [&] {
      kernel(master.data(), mq.data(), vq.data(), mmax.data(), vmax.data(), g.data(),
             std::is_same_v<P, float> ? nullptr : model.data(), maps.data(), n, decay, b1, b2,
             c1, c2, eps, step, inv_bc2, gm, first, 0);
    });
    for (int b = 0; b < blocks; b++) {
      const int lo = b * 256, hi = std::min(n, lo + 256);
      std::vector<float> m(hi - lo), v(hi - lo);
      float am = 0.f, av = 0.f;
      for (int i = lo; i < hi; i++) {
        float mi = first ? 0.f : maps[wmq[i]] * wmmax[b];
        float vi = first ? 0.f : maps[256 + wvq[i]] * wvmax[b];
        // memory/src/host_adamw.rs `element`, operation for operation (`affine` = x * a + 0).
        auto affine = [](float x, float a) { return x * a + 0.f; };
        const float gi = affine(gf[i], gm);
        mi = first ? affine(gi, c1) : affine(mi, b1) + affine(gi, c1);
        vi = first ? affine(gi * gi, c2) : affine(vi, b2) + affine(gi * gi, c2);
        const float denom = affine(std::sqrt(vi), inv_bc2) + eps;
        want[i] = affine(want[i], decay) - affine(mi / denom, step);
        m[i - lo] = mi;
        v[i - lo] = vi;
        if (std::isfinite(mi)) am = std::max(am, std::fabs(mi));
        if (std::isfinite(vi)) av = std::max(av, std::fabs(vi));
      }
      wmmax[b] = am;
      wvmax[b] = av;
      for (int i = lo; i < hi; i++) {
        wmq[i] = code(maps.data(), m[i - lo], am);
        wvq[i] = code(maps.data() + 256, v[i - lo], av);
      }
    }
    auto bits_eq = [](float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); };
    for (int i = 0; i < n; i++) same &= mq[i] == wmq[i] && vq[i] == wvq[i] && bits_eq(master[i], want[i]);
    for (int b = 0; b < blocks; b++) same &= mmax[b] == wmmax[b] && vmax[b] == wvmax[b];
    if constexpr (!std::is_same_v<P, float>) {
      auto mf = back(model);
      for (int i = 0; i < n; i++) same &= bits_eq(mf[i], back(to<P>({master[i]}))[0]);
    }
  }
  // What the blocks must show: the inf stays an extreme code, the NaN the zero code, the zero
  // block keeps a zero maximum, and the finite elements of block 2 stay finite.
  const unsigned char zero = code(maps.data(), 0.f, 1.f);
  bool shape = mq[2 * 256 + 5] == 255 && vq[2 * 256 + 5] == 255 && mq[2 * 256 + 9] == zero &&
               mmax[3] == 0.f && vmax[3] == 0.f && mmax[2] > 0.f;
  for (int i = 2 * 256; i < 3 * 256; i++)
    if (i != 2 * 256 + 5 && i != 2 * 256 + 9) shape &= std::isfinite(master[i]);
  const bool ok = same && shape;
  std::printf("%-48s %s\n", ("adamw 8-bit, 3 steps, " + ty).c_str(), ok ? "ok" : "FAIL");
  failures += !ok;
}

// AdamW without masters (`--full-bf16`): a null master pointer, the bf16 weight read, updated and
// written back stochastically in place, two steps; against the host `element` port and the
// stochastic rounding of the same seed, bit for bit. With seed 0 it rounds to nearest.
static void adamw_in_place_case() {
  const int n = 600;
  auto w = to<bf16>(rnd(n, 60));
  std::vector<float> m(n), v(n), want_m(n), want_v(n);
  auto want = back(w);
  const double lr = 1e-2, b1d = 0.9, b2d = 0.999, wd = 0.01;
  const float b1 = (float)b1d, b2 = (float)b2d, c1 = (float)(1 - b1d), c2 = (float)(1 - b2d),
              eps = 1e-8f, decay = (float)(1 - lr * wd);
  auto affine = [](float x, float a) { return x * a + 0.f; };
  bool same = true;
  for (int t = 1; t <= 2; t++) {
    const auto g = to<bf16>(rnd(n, 60 + t));
    const auto gf = back(g);
    const float step = (float)(lr / (1 - std::pow(b1d, t))),
                inv_bc2 = (float)(1 / std::sqrt(1 - std::pow(b2d, t)));
    const unsigned long long seed = t == 1 ? 12345 : 0;
    launch({3}, {256}, [&] {
      adamw_bf16_bf16(nullptr, m.data(), v.data(), g.data(), w.data(), n, decay, b1, b2, c1, c2,
                      eps, step, inv_bc2, 1.f, t == 1, seed);
    });
    for (int i = 0; i < n; i++) {
      const float gi = gf[i];
      want_m[i] = t == 1 ? affine(gi, c1) : affine(want_m[i], b1) + affine(gi, c1);
      want_v[i] = t == 1 ? affine(gi * gi, c2) : affine(want_v[i], b2) + affine(gi * gi, c2);
      const float denom = affine(std::sqrt(want_v[i]), inv_bc2) + eps;
      const float p = affine(want[i], decay) - affine(want_m[i] / denom, step);
      bf16 r;
      r.x = seed ? bf16_bits_stochastic(p, rand_bits(seed, i)) : bf16_bits(p);
      want[i] = back(std::vector<bf16>{r})[0];
    }
    const auto got = back(w);
    for (int i = 0; i < n; i++)
      same &= got[i] == want[i] && m[i] == want_m[i] && v[i] == want_v[i];
  }
  std::printf("%-48s %s\n", "adamw in place (no master), bf16", same ? "ok" : "FAIL");
  failures += !same;
}

// 8-bit AdamW without masters (`--full-bf16`): a step with a null master, reading and writing the
// bf16 weight in place, against the same step from an fp32 master holding the weight's values
// (set again before each step), with the same seed: weights, codes and maxima bit for bit.
static void adamw8bit_in_place_case() {
  const int n = 2 * 256 + 30, blocks = 3;
  const auto maps = test_maps();
  auto a = to<bf16>(rnd(n, 80));
  auto b = a;
  std::vector<unsigned char> mqa(n), vqa(n), mqb(n), vqb(n);
  std::vector<float> mma(blocks), vma(blocks), mmb(blocks), vmb(blocks);
  bool same = true;
  for (int t = 1; t <= 3; t++) {
    const auto g = to<bf16>(rnd(n, 80 + t));
    auto master = back(a);
    const float step = (float)(1e-2 / (1 - std::pow(0.9, t))),
                inv_bc2 = (float)(1 / std::sqrt(1 - std::pow(0.999, t)));
    const unsigned long long seed = 1000 + t;
    launch({(unsigned)blocks}, {256}, [&] {
      adamw8bit_bf16_bf16(master.data(), mqa.data(), vqa.data(), mma.data(), vma.data(),
                          g.data(), a.data(), maps.data(), n, (float)(1 - 1e-4), 0.9f, 0.999f,
                          0.1f, 0.001f, 1e-8f, step, inv_bc2, 1.f, t == 1, seed);
    });
    launch({(unsigned)blocks}, {256}, [&] {
      adamw8bit_bf16_bf16(nullptr, mqb.data(), vqb.data(), mmb.data(), vmb.data(), g.data(),
                          b.data(), maps.data(), n, (float)(1 - 1e-4), 0.9f, 0.999f, 0.1f,
                          0.001f, 1e-8f, step, inv_bc2, 1.f, t == 1, seed);
    });
    same &= back(a) == back(b) && mqa == mqb && vqa == vqb && mma == mmb && vma == vmb;
  }
  std::printf("%-48s %s\n", "adamw 8-bit in place (no master), bf16", same ? "ok" : "FAIL");
  failures += !same;
}
