#!/usr/bin/env bash
# Installs what `cargo build --features cuda` needs on a machine without a CUDA toolkit: nvcc 13.0,
# CUDA headers and link libraries from NVIDIA's PyPI wheels, plus a link-time stub of libcuda (the
# driver's library, which no wheel ships). Writes PREFIX/env.sh to source before building.
#
#   bash scripts/cuda-toolchain.sh [PREFIX]        (default: ~/.cache/cuda13-pip)
#   WITH_NCCL=1 bash scripts/cuda-toolchain.sh     (also NCCL, for `--features nccl`: 300 MB)
#
# Pinned to CUDA 13.0.x: PTX from a newer nvcc can be refused by a CUDA 13.0 driver (580).
# Machines with a real toolkit do not need this: put its nvcc on PATH and set CUDA_HOME instead.
set -euo pipefail
PREFIX=${1:-$HOME/.cache/cuda13-pip}
mkdir -p "$PREFIX"
[ -x "$PREFIX/venv/bin/python" ] || python3 -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/pip" install -q \
  "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-crt==13.0.88" "nvidia-nvvm==13.0.88" \
  "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-nvrtc==13.0.88" \
  "nvidia-cublas==13.0.2.14" "nvidia-curand==10.4.0.35"
CU=$("$PREFIX/venv/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))')
# NCCL (the GPUs' collectives of ft-dist's `nccl` feature): the version of cudarc's `nccl`
# bindings; a newer libnccl.so.2 (PyTorch's) runs the same calls.
NCCL="$(dirname "$CU")/nccl"
if [ "${WITH_NCCL:-0}" = 1 ]; then
  "$PREFIX/venv/bin/pip" install -q "nvidia-nccl-cu13==2.30.7"
  ln -sf libnccl.so.2 "$NCCL/lib/libnccl.so"
fi
NCCL_LIB=""
[ -e "$NCCL/lib/libnccl.so" ] && NCCL_LIB="$NCCL/lib:"

# The wheels carry versioned sonames only; the linker looks for the plain names.
for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
  [ -e "$CU/lib/$lib" ] && ln -sf "$lib" "$CU/lib/${lib%%.so*}.so"
done

# Link-time stand-in for the driver's libcuda.so.1: every cu* symbol cudarc declares, each
# returning CUDA_ERROR_NO_DEVICE. At run time the real driver library is loaded instead.
STUB="$CU/lib/stubs/libcuda.so"
if [ ! -e "$STUB" ]; then
  mkdir -p "$(dirname "$STUB")"
  CUDARC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.* 2>/dev/null | sort -V | tail -1 || true)
  if [ -z "$CUDARC" ]; then
    (cd "$(dirname "$0")/.." && cargo fetch -q)
    CUDARC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.* | sort -V | tail -1)
  fi
  grep -ohE 'pub unsafe fn cu[A-Za-z0-9_]+\(' "$CUDARC"/src/driver/sys/*.rs \
    | sed 's/pub unsafe fn //; s/(//' | sort -u \
    | awk '{print "int " $1 "(void) { return 100; }"}' > "$PREFIX/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUB" "$PREFIX/libcuda_stub.c"
fi
# Lets a CUDA build start on a machine without a driver (it then finds no device and says so):
# put lib/stubs on LD_LIBRARY_PATH only there, never where a real driver is installed.
ln -sf libcuda.so "$(dirname "$STUB")/libcuda.so.1"

cat > "$PREFIX/env.sh" <<ENV
export PATH="$CU/bin:\$PATH"
export CUDA_HOME="$CU" CUDA_PATH="$CU" CUDA_ROOT="$CU"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
export NVRTC_INCLUDE="$CU/include"
export LIBRARY_PATH="$NCCL_LIB$CU/lib:$CU/lib/stubs:\${LIBRARY_PATH:-}"
# Run time: the CUDA 13 libraries from the wheels (add $CU/lib/stubs only on a machine with no driver).
export LD_LIBRARY_PATH="$NCCL_LIB$CU/lib:\${LD_LIBRARY_PATH:-}"
ENV
echo "$PREFIX/env.sh"
