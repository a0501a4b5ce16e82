#!/usr/bin/env bash
# Prepares a GPU run on a machine that has no network: builds here what scripts/gpu-bench.sh
# runs there (scripts/gpu-build.sh) into .gpu/bins.tar.xz, and downloads the diffusers wheel the
# PyTorch side imports into .whl/. Both folders are git-ignored: carry them to the GPU machine.
#
#   bash scripts/gpu-pack.sh                 # CUDA_COMPUTE_CAP=90 (H100/H200) by default
#
# Then, on the GPU machine, in the repository root (python3 with torch, transformers there):
#
#   python3 -c "import tarfile; tarfile.open('.gpu/bins.tar.xz').extractall('/tmp')"
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site-diff .whl/*.whl
#   BIN_DIR=/tmp/b TORCH_PYTHONPATH=/tmp/site-diff bash scripts/gpu-bench.sh out
#
# (ONLY="tests attention", then ONLY="sdxl", ONLY="t5" splits the run over shorter calls.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${BENCH_PYTHON:-python3}
rm -rf .gpu && mkdir -p .gpu
bash scripts/gpu-build.sh .gpu/b
strip .gpu/b/* 2> /dev/null || true
(cd .gpu && tar cf - b | xz -T0 > bins.tar.xz && rm -rf b)

# diffusers 0.42 imports next to transformers 5 (0.35 does not: huggingface_hub's
# is_offline_mode); no dependencies, the GPU machine's torch stack provides them.
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary :all: -d .whl "diffusers==0.42.1" importlib_metadata
ls -l .gpu .whl
