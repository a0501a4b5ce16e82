#!/usr/bin/env bash
# Resident memory of a command over time: runs it, reads its VmRSS every 0.25 s from
# /proc/PID/status, and prints the highest reading in each 2-second window ("second:MiB"),
# then the highest overall. Why: /usr/bin/time gives only the maximum; this shows when it
# is reached (docs/benchmarks.md, "The allocator keeps its memory mapped between steps").
#
#   scripts/rss_timeline.sh target/release/examples/t5_bench
#   FT_ALLOC_CACHE=0 BENCH_PYTHON=/nonexistent scripts/rss_timeline.sh target/release/examples/t5_bench
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
"$@" > /dev/null 2>&1 &
pid=$!
start=$(date +%s%N)
samples=$(mktemp)
trap 'rm -f "$samples"' EXIT
while kill -0 "$pid" 2>/dev/null; do
  kib=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
  [ -n "$kib" ] && echo "$(( ($(date +%s%N) - start) / 1000000 )) $kib" >> "$samples"
  sleep 0.25
done
wait "$pid" || { echo "$0: the command failed" >&2; exit 1; }
awk '{ w = int($1 / 2000) * 2; if ($2 > m[w]) m[w] = $2; if (!(w in seen)) { seen[w] = 1; order[n++] = w }
       if ($2 > top) top = $2 }
     END { line = ""; for (i = 0; i < n; i++) line = line order[i] ":" int(m[order[i]] / 1024) " ";
           print line; printf "highest: %d MiB\n", top / 1024 }' "$samples"
