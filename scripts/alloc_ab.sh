#!/usr/bin/env bash
# The allocator's block cache on and off (FT_ALLOC_CACHE=1 / 0), alternated: runs one
# `fsct_bench` row (ours alone) RUNS times each way and prints every run's episode time,
# backward minor faults and resident peak above start, then the median times.
# docs/benchmarks.md, "The allocator keeps its memory mapped between steps".
#
#   cargo build --release -p fewshot-ft --example fsct_bench
#   scripts/alloc_ab.sh resnet10 1 6
set -euo pipefail
backbone=${1:?backbone (conv4 or resnet10)}; shots=${2:?shots (1 or 5)}; runs=${3:-6}
bin=${FSCT_BENCH_BIN:-target/release/examples/fsct_bench}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for _ in $(seq "$runs"); do
  for cache in 1 0; do
    log=$(FT_ALLOC_CACHE=$cache FSCT_BENCH_BACKBONE=$backbone FSCT_BENCH_SHOTS=$shots \
          BENCH_PYTHON=/nonexistent "$bin" 2>&1)
    faults=$(echo "$log" | sed -nE 's/.*backward [0-9.]+ s \(peak [^,]*, ([0-9]+) minor faults.*/\1/p')
    row=$(echo "$log" | grep "^| $backbone |")
    time=$(echo "$row" | awk -F'|' '{gsub(/ s|[[:space:]]/, "", $4); print $4}')
    rss=$(echo "$row" | awk -F'|' '{split($8, a, "/"); gsub(/^[[:space:]]+|[[:space:]]+$/, "", a[1]); print a[1]}')
    echo "FT_ALLOC_CACHE=$cache episode $time s, backward faults $faults, resident above start $rss" | tee -a "$out"
  done
done
for cache in 1 0; do
  grep "FT_ALLOC_CACHE=$cache " "$out" | awk '{print $3}' | sort -n |
    awk -v c="$cache" '{v[NR] = $1} END { m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
                        printf "FT_ALLOC_CACHE=%s median %.3f s of %d runs\n", c, m, NR }'
done
