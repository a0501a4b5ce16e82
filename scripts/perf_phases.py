#!/usr/bin/env python3
"""Where the forward's or the backward's samples go, every thread's, by what the chain passes through.

`perf_share.py` keeps the samples whose chain reaches the bench's timed steps, which leaves out
the samples of rayon's worker threads whose chain DWARF could not follow back: on 2 cores about
half of them. This reads `perf script` output of a `perf record --call-graph dwarf` run of
`fsct_phases` (bins/fewshot-ft/examples), whose episodes sleep 0.2 s between the forward and
the backward and 0.4 s after the optimizer step, splits the samples at those gaps and counts
every sample of the chosen phase (all threads), the first episode left out, under the first of
CATEGORIES its chain passes through, with how many of them the kernel took (page faults):

    perf script -i phases.perf | python3 scripts/perf_phases.py backward
"""

import collections
import re
import sys

# (name, a substring of a frame), first match wins: the op's own passes before the matrix
# products they call, candle's backward after ours.
CATEGORIES = [
    ("convolution: the input gradient's fold", "fold_image"),
    ("convolution columns (the unfolding)", "conv::geometry"),
    ("convolution: output gradient side by side", "side_by_side"),
    ("matrix products (gemm)", "gemm_f32"),
    ("matrix products (gemm)", "gemm_common"),
    ("batch norm (with its ReLU, pool, join)", "batch_norm"),
    ("ReLU of a join", "add_relu"),
    ("candle's backward: zero tensors for gradient slots", "GradStore::or_insert"),
    ("candle: elementwise ops on its pool (the backward's adds into gradient slots)", "binary_map_vec_par"),
    ("candle: other", "candle_core"),
    ("this repo's other kernels", "ft_kernels"),
]

# A phase's samples follow a gap of this many seconds (the example's sleeps: 0.2 s before a
# backward, 0.4 s before a forward).
GAPS = {"backward": (0.15, 0.3), "forward": (0.3, 0.6)}


def samples(lines):
    """(time, frames) of each sample of `perf script` output."""
    head, frames = None, []
    for line in lines:
        if not line.strip():
            if head is not None:
                yield head, frames
            head, frames = None, []
        elif not line[0].isspace():
            m = re.match(r"\s*\S+\s+\d+\s+([\d.]+):", line)
            head = float(m.group(1)) if m else None
        else:
            frames.append(line.strip())
    if head is not None:
        yield head, frames


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in GAPS:
        sys.exit("usage: perf script -i FILE | perf_phases.py forward|backward")
    lo, hi = GAPS[sys.argv[1]]
    all_samples = sorted(samples(sys.stdin), key=lambda s: s[0])
    if not all_samples:
        sys.exit("no samples (was the run recorded with --call-graph dwarf?)")
    # Bursts of samples between gaps of over 0.12 s; a phase's bursts follow its gap.
    bursts, start = [], 0
    for i in range(1, len(all_samples)):
        gap = all_samples[i][0] - all_samples[i - 1][0]
        if gap > 0.12:
            bursts.append((start, i, gap))
            start = i
    bursts.append((start, len(all_samples), 0.0))
    chosen = [bursts[b] for b in range(1, len(bursts)) if lo < bursts[b - 1][2] < hi][1:]
    if not chosen:
        sys.exit("no burst of that phase: record `fsct_phases` (it sleeps between phases)")
    counts, kernel = collections.Counter(), collections.Counter()
    n = 0
    for s, e, _ in chosen:
        for _, frames in all_samples[s:e]:
            n += 1
            name = next(
                (c for c, pat in CATEGORIES if any(pat in f for f in frames)),
                "other",
            )
            counts[name] += 1
            if frames and "[kernel.kallsyms]" in frames[0]:
                kernel[name] += 1
    print(f"{sys.argv[1]}: {len(chosen)} phases after the first, {n} samples, {n / len(chosen):.0f} a phase")
    print("| what the chain passes through | samples a phase | share | of them in the kernel |")
    print("|---|---|---|---|")
    for name, k in counts.most_common():
        print(f"| {name} | {k / len(chosen):.0f} | {100 * k / n:.1f}% | {100 * kernel[name] / k:.0f}% |")


if __name__ == "__main__":
    main()
