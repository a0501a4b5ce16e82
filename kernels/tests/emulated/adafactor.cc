// Adafactor (adafactor.cu) against a double reference.
#pragma once

#include "common.h"

// One Adafactor step as kernels/src/cuda/adafactor.rs launches it (geometry shrunk so grid-stride
// loops wrap: at most 3 blocks for element kernels), for a tensor viewed as [B, R, C] (`full`:
// n = B R C values with a full second moment in `row`). `parts_grid` > 0 instead gives the sum
// of squares that many 32-thread blocks and the update 3 blocks of 64 threads, so each of its
// blocks adds more partials than it has threads.
template <typename G, typename P>
static void adafactor_launch(float* master, const G* g, P* model, float* row, float* col,
                             int B, int R, int C, bool full, int chunk, float gm, float eps1,
                             float b2t, float lr, float wd, float clip, unsigned long long seed,
                             void (*rows_k)(const G*, float*, long long, int, int,
                                            ADAFACTOR_ARGS),
                             void (*parts_k)(const G*, float*, float*, long long, int, int, int,
                                             int, ADAFACTOR_ARGS),
                             void (*sumsq_k)(const G*, float*, const float*, const float*,
                                             float*, long long, int, int, ADAFACTOR_ARGS),
                             void (*apply_k)(float*, const G*, P*, const float*, const float*,
                                             const float*, const float*, int, long long, int,
                                             int, ADAFACTOR_ARGS, unsigned long long),
                             unsigned parts_grid = 0) {
  const long long n = (long long)B * R * C;
  const int r = full ? 1 : R, c = full ? 1 : C;
  const float a[10] = {gm,
                       eps1,
                       b2t,
                       (float)(1.0 - (double)b2t),
                       (float)(1.0 / r),
                       (float)(1.0 / c),
                       lr,
                       wd != 0.f ? lr * -wd + 0.f : 0.f,
                       (float)(1.0 / std::sqrt((double)n)),
                       1.f / clip};
#define A10 a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9]
  std::vector<float> rmean(B), part;
  if (!full) {
    // A thread per row shorter than a warp, else a warp per row (8 to a block).
    const int rows_pt = C < 32, mean_pt = R < 32;
    const long long rows = (long long)B * R;
    launch({(unsigned)(rows_pt ? (rows + 255) / 256 : (rows + 7) / 8)}, {256},
           [&] { rows_k(g, row, rows, C, rows_pt, A10); });
    const int chunks = (R + chunk - 1) / chunk;
    const long long bc = (long long)B * C;
    part.assign(chunks > 1 ? bc * chunks : 0, NAN);
    float* pp = chunks > 1 ? part.data() : nullptr;
    launch({grid_for(bc * chunks)}, {256},
           [&] { parts_k(g, col, pp, bc, R, C, chunk, chunks, A10); });
    if (pp) launch({grid_for(bc)}, {256}, [&] { adafactor_cols(pp, col, bc, chunks, A10); });
    launch({(unsigned)(mean_pt ? (B + 255) / 256 : (B + 7) / 8)}, {256},
           [&] { adafactor_row_mean(row, rmean.data(), B, R, mean_pt, a[4]); });
  }
  const unsigned parts = parts_grid ? parts_grid : grid_for(n);
  std::vector<float> sums(parts, NAN);
  const float* rm = full ? nullptr : rmean.data();
  float* cl = full ? nullptr : col;
  launch({parts}, {parts_grid ? 32u : 256u},
         [&] { sumsq_k(g, row, rm, cl, sums.data(), n, r, c, A10); });
  launch({parts_grid ? 3u : parts}, {parts_grid ? 64u : 256u}, [&] {
    apply_k(master, g, model, row, rm, cl, sums.data(), (int)parts, n, r, c, A10, seed);
  });
#undef A10
}

// Three Adafactor steps (transformers' update, HF Trainer's settings) against a double
// reference: the second moment (factored over [B, R, C], or full) and each step's update of the
// fp32 master; the bf16 model weight is the rounded master. `clip` small enough that the RMS
// clip acts.
template <typename G>
static void adafactor_case(const std::string& ty, int B, int R, int C, bool full, int chunk,
                           float clip,
                           void (*rows_k)(const G*, float*, long long, int, int, ADAFACTOR_ARGS),
                           void (*parts_k)(const G*, float*, float*, long long, int, int, int,
                                           int, ADAFACTOR_ARGS),
                           void (*sumsq_k)(const G*, float*, const float*, const float*, float*,
                                           long long, int, int, ADAFACTOR_ARGS),
                           void (*apply_k)(float*, const G*, bf16*, const float*, const float*,
                                           const float*, const float*, int, long long, int, int,
                                           ADAFACTOR_ARGS, unsigned long long),
                           unsigned parts_grid = 0) {
  const long long n = (long long)B * R * C;
  auto master = rnd(n, 90);
  std::vector<bf16> model(n);
  std::vector<float> row(full ? n : (long long)B * R, 0.f), col(full ? 0 : (long long)B * C, 0.f);
  std::vector<double> wm(master.begin(), master.end());
  std::vector<double> wrow(row.size(), 0.0), wcol(col.size(), 0.0);
  const float lr = 1e-2f, wd = 0.1f, gm = 0.5f, eps1 = 1e-30f;
  const std::string name = ty + " adafactor " +
                           (full ? "full " + std::to_string(n)
                                 : std::to_string(B) + "x" + std::to_string(R) + "x" +
                                       std::to_string(C) + " chunk " + std::to_string(chunk)) +
                           (parts_grid ? ", " + std::to_string(parts_grid) + " partials" : "");
  for (int t = 1; t <= 3; t++) {
    const auto g = to<G>(rnd(n, 90 + t));
    const auto gf = back(g);
    const float b2t = (float)(1.0 - std::pow((double)t, -0.8));
    const double b2 = b2t, c2 = 1.0 - b2;
    std::vector<double> u(n), gs(n);
    for (long long i = 0; i < n; i++) gs[i] = (double)gf[i] * gm;
    auto sq = [&](int b, int r, int c) {
      const double x = gs[((long long)b * R + r) * C + c];
      return x * x + eps1;
    };
    if (full) {
      for (long long i = 0; i < n; i++) {
        wrow[i] = b2 * wrow[i] + c2 * (gs[i] * gs[i] + eps1);
        u[i] = gs[i] / std::sqrt(wrow[i]);
      }
    } else {
      for (int b = 0; b < B; b++) {
        for (int r = 0; r < R; r++) {
          double s = 0;
          for (int c = 0; c < C; c++) s += sq(b, r, c);
          wrow[b * R + r] = b2 * wrow[b * R + r] + c2 * s / C;
        }
        for (int c = 0; c < C; c++) {
          double s = 0;
          for (int r = 0; r < R; r++) s += sq(b, r, c);
          wcol[b * C + c] = b2 * wcol[b * C + c] + c2 * s / R;
        }
        double rm = 0;
        for (int r = 0; r < R; r++) rm += wrow[b * R + r] / R;
        for (int r = 0; r < R; r++)
          for (int c = 0; c < C; c++) {
            const long long i = ((long long)b * R + r) * C + c;
            u[i] = gs[i] / std::sqrt(wrow[b * R + r] / rm * wcol[b * C + c]);
          }
      }
    }
    double ss = 0;
    for (double x : u) ss += x * x;
    const double denom = std::max(1.0, std::sqrt(ss / n) / clip);
    std::vector<double> want_step(n);
    const auto before = master;
    for (long long i = 0; i < n; i++) {
      const double p = wm[i] * (1.0 - (double)lr * wd) - (double)lr * u[i] / denom;
      want_step[i] = p - before[i];
      wm[i] = p;
    }
    adafactor_launch<G, bf16>(master.data(), g.data(), model.data(), row.data(), col.data(), B,
                              R, C, full, chunk, gm, eps1, b2t, lr, wd, clip, 0, rows_k,
                              parts_k, sumsq_k, apply_k, parts_grid);
    std::vector<float> got_step(n);
    for (long long i = 0; i < n; i++) got_step[i] = master[i] - before[i];
    const std::string s = name + " step " + std::to_string(t);
    check(s + (full ? " v" : " row"), row, wrow, 1e-5);
    if (!full) check(s + " col", col, wcol, 1e-5);
    check(s + " update", got_step, want_step, 2e-4);
    std::vector<double> rounded(n);
    for (long long i = 0; i < n; i++) rounded[i] = back(to<bf16>({master[i]}))[0];
    check(s + " bf16 weight = rounded master", back(model), rounded, 0);
  }
}

// Adafactor without masters (`--full-bf16`): the bf16 weight read, updated and written back
// stochastically in place, against the same step from an fp32 master holding the weight's
// values, writing the bf16 weight with the same seed: weights and state bit for bit, 3 steps.
static void adafactor_in_place_case() {
  const int B = 3, R = 5, C = 40;
  const long long n = (long long)B * R * C;
  auto a = to<bf16>(rnd(n, 70));
  auto b = a;
  std::vector<float> rowa(B * R), cola(B * C), rowb(B * R), colb(B * C);
  bool same = true;
  for (int t = 1; t <= 3; t++) {
    const auto g = to<bf16>(rnd(n, 70 + t));
    auto master = back(a);
    const float b2t = (float)(1.0 - std::pow((double)t, -0.8));
    const unsigned long long seed = 500 + t;
    adafactor_launch<bf16, bf16>(master.data(), g.data(), a.data(), rowa.data(), cola.data(), B,
                                 R, C, false, 2, 0.25f, 1e-30f, b2t, 1e-2f, 0.01f, 1.f, seed,
                                 adafactor_rows_bf16, adafactor_col_parts_bf16,
                                 adafactor_sumsq_bf16, adafactor_apply_bf16_bf16);
    adafactor_launch<bf16, bf16>(nullptr, g.data(), b.data(), rowb.data(), colb.data(), B, R, C,
                                 false, 2, 0.25f, 1e-30f, b2t, 1e-2f, 0.01f, 1.f, seed,
                                 adafactor_rows_bf16, adafactor_col_parts_bf16,
                                 adafactor_sumsq_bf16, adafactor_apply_bf16_bf16);
    same &= back(a) == back(b) && rowa == rowb && cola == colb;
  }
  std::printf("%-48s %s\n", "adafactor in place (no master), bf16", same ? "ok" : "FAIL");
  failures += !same;
}
