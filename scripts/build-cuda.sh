#!/usr/bin/env bash
# Builds the three binaries with `--features cuda` (release). Uses a CUDA toolkit when `nvcc` is
# on PATH; otherwise installs the PyPI-wheel toolchain of scripts/cuda-toolchain.sh first. The
# Dockerfile runs this same script.
#
#   bash scripts/build-cuda.sh                 # binaries in $CARGO_TARGET_DIR/release (or target/)
#   CUDA_COMPUTE_CAP=80 bash scripts/build-cuda.sh   # A100 (default 90: H100/H200)
#
# Running a binary needs the driver's libcuda.so.1 and the CUDA 13 runtime libraries (libcudart,
# libcublas, libcublasLt, libcurand, libnvrtc) on the library path: a CUDA 13 toolkit or runtime
# image has them; so does `pip install nvidia-cuda-runtime nvidia-cublas nvidia-curand
# nvidia-cuda-nvrtc` (folder: python3 -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))').
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cuda-env.sh
cargo build --release --features cuda -p sdxl-ft -p t5-ft -p fewshot-ft "$@"
