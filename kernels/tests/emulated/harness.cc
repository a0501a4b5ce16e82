// Runs the kernels of kernels/src/cuda (the files of `SOURCES` in nvrtc.rs, in its order) under
// the host emulation (emu.h) and compares each family with a plain double-precision reference
// in its own file here (softmax.cc beside softmax.cu, ...). Launch geometry follows the Rust
// launchers in kernels/src/cuda. Exit status 0 when every check passes; driven by
// kernels/tests/emulated.rs.
#include <unistd.h>

#include <cstdio>
#include <string>

#include "emu.h"
// The kernel files, in nvrtc.rs's order.
#include "../../src/cuda/prelude.cuh"
#include "../../src/cuda/softmax.cu"
#include "../../src/cuda/norm.cu"
#include "../../src/cuda/upsample.cu"
#include "../../src/cuda/pool.cu"
#include "../../src/cuda/attention.cu"
#include "../../src/cuda/attention_tc.cu"
#include "../../src/cuda/adamw.cu"
#include "../../src/cuda/adafactor.cu"
#include "../../src/cuda/grad_norm.cu"
#include "../../src/cuda/rounding.cu"
#include "../../src/cuda/dropout.cu"
#include "../../src/cuda/gated.cu"
#include "../../src/cuda/norm_affine.cu"
// Their checks, one file per family.
#include "softmax.cc"
#include "norm.cc"
#include "upsample.cc"
#include "pool.cc"
#include "attention.cc"
#include "adamw.cc"
#include "rounding.cc"
#include "adafactor.cc"
#include "grad_norm.cc"
#include "dropout.cc"
#include "gated.cc"
#include "norm_affine.cc"

int main(int argc, char** argv) {
  // A warp-level call that not every lane reaches (a shuffle behind a divergent branch) waits
  // forever at the emulated warp barrier: end the run with SIGALRM instead of hanging CI.
  alarm(600);
  // `atomics`: only the kernels built on the double atomic add, for the build that takes the
  // compare-and-swap fallback of GPUs below sm_60 (-D__CUDA_ARCH__=520).
  if (argc > 1 && std::string(argv[1]) == "atomics") {
    atomic_add_f64_case();
    sum_squares_case();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 600
    const bool raced = cas_retries > 0;
    std::printf("%-48s %lld retries %s\n", "compare-and-swap loop retried under contention",
                (long long)cas_retries, raced ? "ok" : "FAIL");
    failures += !raced;
#endif
    std::printf("%d failure(s)\n", failures);
    return failures ? 1 : 0;
  }
  for (int log_ = 0; log_ <= 1; log_++) {
    softmax_case<float>("f32", 5, 8, log_, 1e-5, softmax_fwd_f32, softmax_bwd_f32);
    softmax_case<float>("f32", 5, 37, log_, 1e-5, softmax_fwd_f32, softmax_bwd_f32);
    softmax_case<float>("f32", 3, 700, log_, 1e-5, softmax_fwd_f32, softmax_bwd_f32);
    softmax_case<bf16>("bf16", 4, 300, log_, 1e-2, softmax_fwd_bf16, softmax_bwd_bf16);
  }
  for (int center = 0; center <= 1; center++) {
    norm_case<float>("f32", 6, 48, center, 1e-5, norm_fwd_f32, norm_bwd_f32);
    norm_case<float>("f32", 2, 1500, center, 1e-5, norm_fwd_f32, norm_bwd_f32);
    norm_case<f16>("f16", 3, 96, center, 2e-3, norm_fwd_f16, norm_bwd_f16);
  }
  upsample_case();
  pool_case(3, 3, 2, 2, 0, 11, 9);
  pool_case(2, 2, 2, 2, 1, 10, 7);
  pool_case(2, 3, 1, 1, 0, 6, 7);
  const AttnCase cases[] = {{2, 3, 130, 130, 0.125f, 0, false},
                            {2, 2, 70, 77, 1.0f, 1, false},
                            {2, 2, 40, 40, 0.125f, 2, false},
                            {2, 1, 33, 65, 0.125f, 2, true}};
  for (const auto& c : cases)
    attention_case<float>("f32", c, 1e-5, attn_fwd_f32, attn_delta_f32, attn_bwd_q_f32,
                          attn_bwd_kv_f32);
  attention_case<bf16>("bf16", cases[1], 1e-2, attn_fwd_bf16, attn_delta_bf16, attn_bwd_q_bf16,
                       attn_bwd_kv_bf16);
  // The tensor-core kernels (4 warps per 64 rows): the forward with the CUDA-core backward,
  // then all of them together.
  for (const auto& c : cases)
    attention_case<bf16>("bf16 tc forward", c, 1e-2, attn_fwd_tc_bf16, attn_delta_bf16,
                         attn_bwd_q_bf16, attn_bwd_kv_bf16, 128);
  for (const auto& c : cases)
    attention_case<bf16>("bf16 tc fwd+bwd", c, 1e-2, attn_fwd_tc_bf16, attn_delta_bf16,
                         attn_bwd_q_tc_bf16, attn_bwd_kv_tc_bf16, 128);
  adamw_case();
  adamw_in_place_case();
  adamw8bit_in_place_case();
  quantize_codes_case();
  adamw8bit_case<bf16, bf16>("bf16 gradient, bf16 weight", adamw8bit_bf16_bf16);
  adamw8bit_case<float, float>("f32 gradient, masters only", adamw8bit_f32_f32);
  adafactor_case<float>("f32", 2, 37, 45, false, 32, 0.5f, adafactor_rows_f32,
                        adafactor_col_parts_f32, adafactor_sumsq_f32, adafactor_apply_f32_bf16);
  adafactor_case<bf16>("bf16", 2, 37, 45, false, 4, 1.f, adafactor_rows_bf16,
                       adafactor_col_parts_bf16, adafactor_sumsq_bf16, adafactor_apply_bf16_bf16);
  // A 3x3 convolution: [out, in, 3, 3] factored over its kernel dims, one chunk.
  adafactor_case<bf16>("bf16", 40, 3, 3, false, 32, 1.f, adafactor_rows_bf16,
                       adafactor_col_parts_bf16, adafactor_sumsq_bf16, adafactor_apply_bf16_bf16);
  adafactor_case<float>("f32", 1, 1, 777, true, 32, 0.5f, adafactor_rows_f32,
                        adafactor_col_parts_f32, adafactor_sumsq_f32, adafactor_apply_f32_bf16);
  // Past 300 x 32 values, so that every one of the 300 partials holds some.
  adafactor_case<float>("f32", 1, 1, 10007, true, 32, 0.5f, adafactor_rows_f32,
                        adafactor_col_parts_f32, adafactor_sumsq_f32, adafactor_apply_f32_bf16,
                        300);
  adafactor_in_place_case();
  stochastic_case();
  dropout_case();
  gated_case();
  norm_affine_case();
  sum_squares_case();
  atomic_add_f64_case();
  unscale_case();
  std::printf("%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
