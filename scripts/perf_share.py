#!/usr/bin/env python3
"""Where a bench's train step spends its samples, by what the call chain passes through.

Reads `perf script` output of a `perf record --call-graph dwarf` run of one of the benches
(`t5_bench`, `sdxl_bench`, `fsct_bench`, built with line tables: see docs/benchmarks.md) on
stdin, keeps the samples whose chain reaches `measure_steps` (the timed steps; samples on
rayon's worker threads whose chain DWARF could not follow back are left out, so the shares are
of what can be attributed), and counts each sample once, under the first of CATEGORIES its
chain passes through:

    perf script -i unet.perf | python3 scripts/perf_share.py
"""

import collections
import sys

# (name, a substring of a frame, a substring the chain must also hold or None), first match wins.
CATEGORIES = [
    ("matrix products (gemm)", "gemm_f32::", None),
    ("candle's backward: adds into gradient slots", "candle_core::tensor::Tensor::add+", "backprop"),
    ("candle's backward: zero tensors for gradient slots", "GradStore::or_insert", None),
    ("AdamW step", "host_adamw", None),
    ("activations (GELU, SiLU)", "ft_kernels::activation", None),
    ("gradient norm", "block_sum_squares", None),
    ("convolution columns and fold", "ft_kernels::conv::geometry", None),
    ("norms", "ft_kernels::norm", None),
    ("batch norm", "ft_kernels::batch_norm", None),
    ("pooling", "ft_kernels::pool", None),
    ("cross-entropy", "ft_kernels::cross_entropy", None),
]


def main():
    counts = collections.Counter()
    total = attributed = 0
    chain = []

    def done(frames):
        nonlocal total, attributed
        if not frames:
            return
        total += 1
        text = "".join(frames)
        if "measure_steps" not in text:
            return
        attributed += 1
        for name, frame, also in CATEGORIES:
            if frame in text and (also is None or also in text):
                counts[name] += 1
                return
        counts["other"] += 1

    for line in sys.stdin:
        if line.strip():
            chain.append(line)
        else:
            done(chain)
            chain = []
    done(chain)
    if attributed == 0:
        sys.exit("no sample reaches measure_steps: was the run recorded with --call-graph dwarf?")
    print(f"{total} samples, {attributed} with a chain reaching the timed steps")
    print("| what the chain passes through | samples | share |")
    print("|---|---|---|")
    for name, n in counts.most_common():
        print(f"| {name} | {n} | {100 * n / attributed:.1f}% |")


if __name__ == "__main__":
    main()
