#!/usr/bin/env bash
# Builds what scripts/gpu-bench.sh runs, with --features cuda (release): `gpu_bench` (ft-trainer),
# the ft-kernels and ft-trainer CUDA test executables (`cuda_tests`, `memory_cuda_tests`), the
# per-family kernel timings (ft-kernels' `time_*` examples), NCCL's tests on one GPU
# (`nccl_tests`, `nccl_trainer_tests`), and the `t5-ft`, `sdxl-ft` and
# `fewshot-ft` binaries (scripts/gpu-fit-xl.sh, the demos on the card), copied into DIR.
#
#   bash scripts/gpu-build.sh DIR             # CUDA_COMPUTE_CAP=90 (H100/H200) by default
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: gpu-build.sh DIR}
PY=${BENCH_PYTHON:-python3}
. scripts/cuda-env.sh
T=${CARGO_TARGET_DIR:-target}
cargo build --release --features cuda -p ft-trainer --example gpu_bench
cargo build --release --features cuda -p ft-kernels --examples
cargo build --release --features cuda -p t5-ft -p sdxl-ft -p fewshot-ft
test_exe() {
  cargo test --release --features cuda -p "$1" --test cuda --no-run --message-format=json \
    | "$PY" -c 'import json,sys; print([j["executable"] for j in map(json.loads, sys.stdin) if j.get("executable")][-1])'
}
mkdir -p "$DIR"
cp "$T/release/examples/gpu_bench" "$DIR/gpu_bench"
cp "$T/release/t5-ft" "$T/release/sdxl-ft" "$T/release/fewshot-ft" "$DIR/"
for f in kernels/examples/time_*.rs; do
  name=$(basename "$f" .rs)
  cp "$T/release/examples/$name" "$DIR/$name"
done
cp "$(test_exe ft-kernels)" "$DIR/cuda_tests"
cp "$(test_exe ft-trainer)" "$DIR/memory_cuda_tests"

# NCCL on one GPU (the `nccl` feature without `mpi`: no libmpi needed there): ft-dist's
# collectives and ft-trainer's GPU bucket (its unit tests; scripts/gpu-checks.sh runs
# `gpu_tests`). Links libnccl.so.2: the wheel of scripts/cuda-toolchain.sh unless one is installed.
# (grep -c reads all of ldconfig's output: -q could stop early and, under pipefail, fail.)
if ! ldconfig -p 2> /dev/null | grep -c "libnccl.so " > /dev/null && [[ "${LIBRARY_PATH:-}" != *nccl* ]]; then
  # shellcheck disable=SC1090
  . "$(WITH_NCCL=1 bash scripts/cuda-toolchain.sh "${CUDA_PIP_PREFIX:-$HOME/.cache/cuda13-pip}" | tail -1)"
fi
nccl_exe() {
  cargo test --release --features nccl -p "$1" "${@:2}" --no-run --message-format=json \
    | "$PY" -c 'import json,sys; print([j["executable"] for j in map(json.loads, sys.stdin) if j.get("executable")][-1])'
}
cp "$(nccl_exe ft-dist --test nccl)" "$DIR/nccl_tests"
cp "$(nccl_exe ft-trainer --lib)" "$DIR/nccl_trainer_tests"
