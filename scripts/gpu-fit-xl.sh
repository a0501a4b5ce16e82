#!/usr/bin/env bash
# t5-ft under --fit on a GPU at FLAN-T5-XL's shape (docs/benchmarks.md, "`--fit` on the GPU"):
# a model folder with FLAN-T5-XL's config.json (and the demo's word-level tokenizer) trained
# from scratch on 256 records of 600 + 200 digits, so every micro-batch is 8 x (512 + 128)
# tokens, at --fit 24GiB, 16GiB and 8GiB (batch 8, accumulation 2, 3 steps); then a
# T5-large-shaped model (24 + 24 layers of 1024, batch 4 x (256 + 64)) under the strategies the
# 8GiB choice combines, with accumulation 1 and 2. Each run's end table and metrics.jsonl lines
# (peak_bytes against predicted_peak_bytes) go to OUT/fit-xl.log, its memory.svg to OUT.
#
#   T5FT=path/to/t5-ft bash scripts/gpu-fit-xl.sh OUT     # t5-ft built with --features cuda
#
# DEVICE (default cuda) and EXTRA (more flags, e.g. "--plan" to print the choices without a GPU)
# are passed on; ROWS (default all) names the runs to make, e.g. ROWS="xl-fit-8GiB
# large-fullhost-fused-accum2", so a short device call can rerun one row. Checkpoints go to a temporary folder, removed after each run (FLAN-T5-XL's fill
# a disk fast).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-fit-out}
T5FT=${T5FT:-t5-ft}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

model() { # folder d_model d_ff heads
  mkdir -p "$1"
  cp configs/demo/t5/tokenizer.json "$1/"
  cat > "$1/config.json" << JSON
{"d_ff": $3, "d_kv": 64, "d_model": $2, "num_heads": $4, "num_layers": 24,
 "num_decoder_layers": 24, "feed_forward_proj": "gated-gelu", "dropout_rate": 0.1,
 "tie_word_embeddings": false, "vocab_size": 32128, "model_type": "t5",
 "decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
JSON
}
model "$WORK/xl" 2048 5120 32
model "$WORK/large" 1024 2816 16
python3 - "$WORK/data.jsonl" << 'PY'
import json, random, sys
r = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(256):
        f.write(json.dumps({"input": "reverse: " + " ".join(str(r.randrange(10)) for _ in range(600)),
                            "target": " ".join(str(r.randrange(10)) for _ in range(200))}) + "\n")
PY

run() { # name model flags...
  local name=$1 dir=$2
  shift 2
  [ -n "${ROWS:-}" ] && [[ " $ROWS " != *" $name "* ]] && return
  echo "=== $name: $*"
  # shellcheck disable=SC2086
  timeout "${RUN_TIMEOUT:-300}" "$T5FT" --model "$dir" --from-scratch --train-file "$WORK/data.jsonl" \
    --device "$DEVICE" --max-steps 3 --quiet --output-dir "$WORK/$name" "$@" ${EXTRA:-} 2>&1 |
    grep -v "^ *$" | tail -30
  [ -f "$WORK/$name/metrics.jsonl" ] && grep -o '"peak_bytes":[0-9]*,"predicted_peak_bytes":[0-9]*\|"peak_bytes":[0-9]*' "$WORK/$name/metrics.jsonl"
  [ -f "$WORK/$name/memory.svg" ] && cp "$WORK/$name/memory.svg" "$OUT/memory-$name.svg"
  rm -rf "$WORK/$name"
}
{
  for f in 24GiB 16GiB 8GiB; do
    run "xl-fit-$f" "$WORK/xl" --batch-size 8 --accum 2 --fit "$f"
  done
  L=(--batch-size 4 --max-source-length 256 --max-target-length 64 --optim adamw8bit --offload-optimizer)
  run large-fullhost-fused "$WORK/large" "${L[@]}" --checkpointing full-host --fused-backward
  run large-full-fused "$WORK/large" "${L[@]}" --checkpointing full --fused-backward
  run large-fullhost "$WORK/large" "${L[@]}" --checkpointing full-host
  run large-fullhost-fused-accum2 "$WORK/large" "${L[@]}" --checkpointing full-host --fused-backward --accum 2
} 2>&1 | tee "$OUT/fit-xl.log"
