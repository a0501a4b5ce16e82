#!/usr/bin/env bash
# Prepares a GPU run on a machine that has no network: builds here what scripts/gpu-bench.sh
# runs there (scripts/gpu-build.sh), packed in two parts so that each, with the repository and
# the wheels, stays under a 64 MiB transfer: .gpu/main/bins.tar.xz (gpu_bench, the CUDA tests,
# t5-ft, sdxl-ft, fewshot-ft: about 43 MB), .gpu/kernels/bins.tar.xz (the `time_*` kernel timings: about
# 45 MB) and .gpu/nccl/bins.tar.xz (NCCL's tests on one GPU, scripts/gpu-checks.sh); and downloads the diffusers wheel the PyTorch side imports into .whl/. Both folders
# are git-ignored: carry them to the GPU machine.
#
#   bash scripts/gpu-pack.sh                 # CUDA_COMPUTE_CAP=90 (H100/H200) by default
#
# Then, on the GPU machine, in the repository root (python3 with torch, transformers there):
#
#   for t in .gpu/*/bins.tar.xz; do python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/tmp')" $t; done
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site-diff .whl/*.whl
#   BIN_DIR=/tmp/b TORCH_PYTHONPATH=/tmp/site-diff bash scripts/gpu-bench.sh out
#   T5FT=/tmp/b/t5-ft bash scripts/gpu-fit-xl.sh out      # t5-ft at FLAN-T5-XL's shape under --fit
#
# (ONLY="tests attention", ONLY=sdxl, ONLY="t5 offload 8bit", ONLY="lowmem fused" and
# ONLY=kernels split the run over calls of under 10 minutes; the kernels part needs only
# .gpu/kernels, the others only .gpu/main and .whl.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${BENCH_PYTHON:-python3}
rm -rf .gpu && mkdir -p .gpu/main .gpu/kernels .gpu/nccl
bash scripts/gpu-build.sh .gpu/b
strip .gpu/b/* 2> /dev/null || true
(cd .gpu && tar cf - b/time_* | xz -T0 > kernels/bins.tar.xz && rm b/time_*)
(cd .gpu && tar cf - b/nccl_* | xz -T0 > nccl/bins.tar.xz && rm b/nccl_*)
(cd .gpu && tar cf - b | xz -T0 > main/bins.tar.xz && rm -rf b)

# diffusers 0.42 imports next to transformers 5 (0.35 does not: huggingface_hub's
# is_offline_mode); no dependencies, the GPU machine's torch stack provides them.
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary :all: -d .whl "diffusers==0.42.1" importlib_metadata
ls -l .gpu/* .whl
