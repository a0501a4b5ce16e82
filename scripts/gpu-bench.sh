#!/usr/bin/env bash
# GPU checks and benchmarks in one go, for a machine with an NVIDIA GPU: the CUDA op tests
# against the CPU reference, each kernel family's timing (checked against its CPU reference
# first), then the attention kernels, the full SDXL UNet and the
# FLAN-T5-XL-shaped model next to PyTorch on the same card (PyTorch runs after the Rust process has
# exited, so each side has the card to itself). Prints the tables of docs/benchmarks.md last.
#
#   bash scripts/gpu-bench.sh [out-dir]          # builds first (scripts/gpu-build.sh)
#   BIN_DIR=dir bash scripts/gpu-bench.sh out    # prebuilt `gpu_bench`, `cuda_tests` (ft-kernels),
#                                                # `memory_cuda_tests` (ft-trainer), `time_*` in dir
#
# Needs python3 with torch (CUDA), transformers and diffusers for the PyTorch side; set
# TORCH_PYTHONPATH to add a folder holding diffusers (0.42 imports with transformers 5).
# SDXL_PX (default 128,1024), T5_SHAPE (default "8 512 128") choose the sizes; BASELINE=0 skips
# the second candle run on candle's own ops (FT_CUDA_KERNELS=0). ONLY (default "tests kernels
# attention sdxl t5"; "kernels" runs every time_* example into out/kernels.txt; also "offload": both models with the optimizer state on the host, FT_OFFLOAD=1; "8bit":
# both with 8-bit AdamW moments on the GPU, FT_OPTIM=adamw8bit; "lowmem": both as kohya's
# low-memory recipe, bf16 weights without masters and Adafactor, next to PyTorch's same, plus
# SDXL's Adafactor on candle's ops at 128 px unless BASELINE=0; "fused":
# that recipe with the fused backward pass on both sides, FT_FUSED=1) picks the
# parts, so a run can be split over calls that each have a time limit; results are appended to
# out/results.jsonl and the tables are printed from all of them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-bench-out}
mkdir -p "$OUT"
PY=${BENCH_PYTHON:-python3}

if [ -z "${BIN_DIR:-}" ]; then
  BIN_DIR=$(mktemp -d)
  bash scripts/gpu-build.sh "$BIN_DIR" || exit 1
fi

# The CUDA 13 libraries: a toolkit's, else the ones PyTorch's wheels bring.
for d in /usr/local/cuda/lib64 $("$PY" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null); do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

ONLY=" ${ONLY:-tests kernels attention sdxl t5} "
want() { [[ "$ONLY" == *" $1 "* ]]; }
step() { echo "== $*" >&2; }
TO="timeout ${STEP_TIMEOUT:-900}"
if want tests; then
  step "CUDA op tests against the CPU reference"
  {
    export FT_REQUIRE_GPU=1 # no silent skips here
    $TO "$BIN_DIR/cuda_tests" --test-threads=1 --nocapture
    [ -x "$BIN_DIR/memory_cuda_tests" ] && $TO "$BIN_DIR/memory_cuda_tests" --test-threads=1 --nocapture
  } 2>&1 | tee "$OUT/cuda_tests.log" | tail -40
fi

if want kernels; then
  step "kernel timings, one example per family"
  for t in "$BIN_DIR"/time_*; do
    [ -x "$t" ] || continue
    echo "## $(basename "$t")"
    $TO "$t"
  done 2>&1 | tee "$OUT/kernels.txt"
fi

R="$OUT/results.jsonl"
touch "$R"
if want attention; then
  step "attention"
  $TO "$BIN_DIR/gpu_bench" attention | tee -a "$R"
  FT_ATTENTION_TC=0 $TO "$BIN_DIR/gpu_bench" attention kernel-only | tee -a "$R"
  $TO "$PY" scripts/gpu_bench_torch.py attention | tee -a "$R"
fi
if want sdxl; then
  step "SDXL UNet"
  $TO "$BIN_DIR/gpu_bench" sdxl "${SDXL_PX:-128,1024}" ck | tee -a "$R"
  # The same run on candle's ops instead of the project's kernels (FT_CUDA_KERNELS=0): the baseline.
  [ "${BASELINE:-1}" = 1 ] && FT_CUDA_KERNELS=0 $TO "$BIN_DIR/gpu_bench" sdxl "${SDXL_PX:-128,1024}" ck | tee -a "$R"
  PYTHONPATH="${TORCH_PYTHONPATH:-}${PYTHONPATH:+:$PYTHONPATH}" \
    $TO "$PY" scripts/gpu_bench_torch.py sdxl "${SDXL_PX:-128,1024}" ck | tee -a "$R"
fi
if want t5; then
  step "FLAN-T5-XL"
  # shellcheck disable=SC2086
  $TO "$BIN_DIR/gpu_bench" t5 ${T5_SHAPE:-8 512 128} ck | tee -a "$R"
  # shellcheck disable=SC2086
  [ "${BASELINE:-1}" = 1 ] && FT_CUDA_KERNELS=0 $TO "$BIN_DIR/gpu_bench" t5 ${T5_SHAPE:-8 512 128} ck | tee -a "$R"
  # shellcheck disable=SC2086
  $TO "$PY" scripts/gpu_bench_torch.py t5 ${T5_SHAPE:-8 512 128} ck | tee -a "$R"
fi
if want offload; then
  step "optimizer state on the host"
  FT_OFFLOAD=1 $TO "$BIN_DIR/gpu_bench" sdxl "${SDXL_PX:-128,1024}" ck | tee -a "$R"
  # shellcheck disable=SC2086
  FT_OFFLOAD=1 $TO "$BIN_DIR/gpu_bench" t5 ${T5_SHAPE:-8 512 128} ck | tee -a "$R"
fi
if want 8bit; then
  step "8-bit AdamW moments on the GPU"
  FT_OPTIM=adamw8bit $TO "$BIN_DIR/gpu_bench" sdxl "${SDXL_PX:-128,1024}" ck | tee -a "$R"
  # shellcheck disable=SC2086
  FT_OPTIM=adamw8bit $TO "$BIN_DIR/gpu_bench" t5 ${T5_SHAPE:-8 512 128} ck | tee -a "$R"
fi
if want lowmem; then
  step "bf16 weights without masters, Adafactor"
  FT_FULL_BF16=1 FT_OPTIM=adafactor $TO "$BIN_DIR/gpu_bench" sdxl "${SDXL_PX:-128,1024}" ck | tee -a "$R"
  # Adafactor on candle's ops instead of its fused kernels, at 128 px where the step matters most.
  [ "${BASELINE:-1}" = 1 ] && FT_FULL_BF16=1 FT_OPTIM=adafactor FT_CUDA_KERNELS=0 \
    $TO "$BIN_DIR/gpu_bench" sdxl 128 ck | tee -a "$R"
  # shellcheck disable=SC2086
  FT_FULL_BF16=1 FT_OPTIM=adafactor $TO "$BIN_DIR/gpu_bench" t5 ${T5_SHAPE:-8 512 128} ck | tee -a "$R"
  PYTHONPATH="${TORCH_PYTHONPATH:-}${PYTHONPATH:+:$PYTHONPATH}" TORCH_MODES=bf16-adafactor \
    $TO "$PY" scripts/gpu_bench_torch.py sdxl "${SDXL_PX:-128,1024}" ck | tee -a "$R"
  # shellcheck disable=SC2086
  TORCH_MODES=bf16-adafactor $TO "$PY" scripts/gpu_bench_torch.py t5 ${T5_SHAPE:-8 512 128} ck | tee -a "$R"
fi
if want fused; then
  step "bf16 weights without masters, Adafactor, fused backward pass"
  FT_FUSED=1 FT_FULL_BF16=1 FT_OPTIM=adafactor $TO "$BIN_DIR/gpu_bench" sdxl "${SDXL_PX:-128,1024}" ck | tee -a "$R"
  # shellcheck disable=SC2086
  FT_FUSED=1 FT_FULL_BF16=1 FT_OPTIM=adafactor $TO "$BIN_DIR/gpu_bench" t5 ${T5_SHAPE:-8 512 128} ck | tee -a "$R"
  PYTHONPATH="${TORCH_PYTHONPATH:-}${PYTHONPATH:+:$PYTHONPATH}" TORCH_MODES=bf16-adafactor-fused \
    $TO "$PY" scripts/gpu_bench_torch.py sdxl "${SDXL_PX:-128,1024}" ck | tee -a "$R"
  # shellcheck disable=SC2086
  TORCH_MODES=bf16-adafactor-fused $TO "$PY" scripts/gpu_bench_torch.py t5 ${T5_SHAPE:-8 512 128} ck | tee -a "$R"
fi
"$PY" scripts/gpu_bench_table.py "$R" | tee "$OUT/tables.md"
