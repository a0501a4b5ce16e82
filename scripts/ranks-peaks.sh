#!/usr/bin/env bash
# Rank 0's exact heap peaks of a data-parallel t5-ft run on the CPU, by phase, from its
# memory.jsonl (the counting allocator): NP ranks (default 2) under `mpirun`, ZeRO 0/1/2
# (NP=1: one process, no `mpirun`, ZeRO 0 alone), checkpointing
# `none` and `blocks`, 1 and 2 micro-batches a step, on a medium T5 (d_model 256, d_ff 1024,
# 4 + 4 layers, 9.5M parameters, fp32) trained from scratch for 3 steps on the demo's data.
# Given two binaries (say, before and after a change), each row runs both.
#
#   cargo build -p t5-ft --features "ft-dist/mpi,ft-trainer/mpi,t5-ft/mpi"
#   bash scripts/ranks-peaks.sh target/debug/t5-ft [other/t5-ft]
#   NP=1 bash scripts/ranks-peaks.sh target/debug/t5-ft       # one process (any build)
#   EXTRA="--fused-backward" CHECKPOINTING=blocks bash scripts/ranks-peaks.sh ...  # more flags
#
# Peaks count the steps after the first (step 0's first forward makes the allocator's caches).
# The `step` phase is the update (and, before the sums moved into the backward, their reduce).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: [NP=N] $0 T5_FT_BINARY [ANOTHER]" >&2; exit 2; }
NP=${NP:-2}
CHECKPOINTING=${CHECKPOINTING:-none blocks}
read -r -a EXTRA_FLAGS <<< "${EXTRA:-}"
ZEROS="0 1 2"
[ "$NP" -gt 1 ] || ZEROS=0
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}

# The demo's tokenizer and data (written by `--demo --plan`), a larger config.
"$1" --demo --plan --output-dir "$WORK/demo" > /dev/null
mkdir -p "$WORK/model"
cp "$WORK/demo/demo-data/model/tokenizer.json" "$WORK/model/"
python3 - "$WORK" <<'PY'
import json, sys
w = sys.argv[1]
c = json.load(open(f"{w}/demo/demo-data/model/config.json"))
c.update(d_model=256, d_kv=32, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=8)
json.dump(c, open(f"{w}/model/config.json", "w"), indent=1)
lines = open(f"{w}/demo/demo-data/train.jsonl").read().splitlines()[:200]
open(f"{w}/train.jsonl", "w").write("\n".join(lines) + "\n")
PY

printf '| binary | --zero | --checkpointing | --accum | forward | backward | step | run | --plan | plan / run |\n'
printf '|---|---|---|---|---|---|---|---|---|---|\n'
for zero in $ZEROS; do
  for ck in $CHECKPOINTING; do
    for accum in 1 2; do
      for bin in "$@"; do
        out="$WORK/run"
        rm -rf "$out"
        flags=(--model "$WORK/model" --from-scratch --train-file "$WORK/train.jsonl" --batch-size 4
          --zero "$zero" --checkpointing "$ck" --accum "$accum" --output-dir "$out"
          "${EXTRA_FLAGS[@]}")
        if [ "$NP" -gt 1 ]; then
          mpirun --oversubscribe -np "$NP" -x RAYON_NUM_THREADS=1 "$bin" "${flags[@]}" \
            --max-steps 3 --quiet > "$WORK/log" 2>&1 || { cat "$WORK/log" >&2; exit 1; }
        else
          RAYON_NUM_THREADS=1 "$bin" "${flags[@]}" --max-steps 3 --quiet > "$WORK/log" 2>&1 \
            || { cat "$WORK/log" >&2; exit 1; }
        fi
        # What `--plan` says of one of NP ranks (the total on the CPU, in bytes).
        "$bin" "${flags[@]}" --plan --plan-ranks "$NP" > "$WORK/plan" 2>&1 || { cat "$WORK/plan" >&2; exit 1; }
        python3 - "$out/memory.jsonl" "$bin" "$zero" "$ck" "$accum" "$WORK/plan" <<'PY'
import json, sys
path, bin_, zero, ck, accum, plan = sys.argv[1:]
rows = [json.loads(l) for l in open(path)]
def peak(phase):
    return max((r["peak_bytes"] for r in rows if r["phase"] == phase and r["step"] >= 1), default=0)
ph = [peak(p) for p in ("forward", "backward", "step")]
mib = lambda b: f"{b / 2**20:.2f} MiB"
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
line = next(l for l in open(plan) if "total on the CPU" in l)
value, unit = line.split("|")[3].split()
planned = float(value) * units[unit]
print(f"| {bin_} | {zero} | {ck} | {accum} | " + " | ".join(mib(b) for b in ph)
      + f" | {mib(max(ph))} | {mib(planned)} | {planned / max(ph):.3f} |")
PY
      done
    done
  done
done
