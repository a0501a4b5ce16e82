# Sourced by the CUDA build scripts: puts nvcc on PATH (a toolkit's, else the PyPI-wheel toolchain
# of scripts/cuda-toolchain.sh, installed on first use) and sets CUDA_COMPUTE_CAP (default 90).
if ! command -v nvcc > /dev/null; then
  _ft_env=$(bash "$(dirname "${BASH_SOURCE[0]}")/cuda-toolchain.sh" "${CUDA_PIP_PREFIX:-$HOME/.cache/cuda13-pip}" | tail -1)
  # shellcheck disable=SC1090
  . "$_ft_env"
fi
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
