# Multi-stage image with the three binaries built for CUDA.
#
#   docker build -t memft .                                   # CUDA_COMPUTE_CAP=90 (H100/H200)
#   docker build --build-arg CUDA_COMPUTE_CAP=89 -t memft .   # RTX 4090
#
#   docker run --gpus all -e HF_TOKEN \
#     -v "$HOME/.cache/huggingface:/root/.cache/huggingface" -v "$PWD/images:/data" -v "$PWD/runs:/runs" \
#     memft sdxl-ft --res 128 --accum 16 --data-dir /data --device cuda --output-dir /runs/sdxl
#
#   # data parallel over the host's GPUs (one rank a GPU; the binaries are built with `mpi`):
#   docker run --gpus all ... memft mpirun --allow-run-as-root -np 5 \
#     sdxl-ft --res 128 --accum 16 --data-dir /data --device cuda --output-dir /runs/sdxl
#
# The build stage runs scripts/build-cuda.sh, the same script a machine without the image uses
# (here nvcc comes from the devel image, so the script skips its PyPI toolchain).
ARG CUDA_VERSION=13.0.0
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl gcc libc6-dev python3 python3-venv \
    libopenmpi-dev openmpi-bin libclang-dev \
 && rm -rf /var/lib/apt/lists/*
RUN curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
ENV PATH=/root/.cargo/bin:$PATH
ARG CUDA_COMPUTE_CAP=90
ENV CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} CARGO_TARGET_DIR=/build
WORKDIR /src
COPY . .
RUN bash scripts/build-cuda.sh --features mpi \
 && mkdir -p /out && cp /build/release/sdxl-ft /build/release/t5-ft /build/release/fewshot-ft /out/

# The runtime image carries libcudart, libcublas(Lt), libcurand and libnvrtc; the driver's
# libcuda.so.1 comes from the host through the NVIDIA container toolkit (`--gpus all`).
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
# OpenMPI: mpirun, and the library the binaries' data-parallel ranks talk through.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openmpi-bin \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
ENV HF_HOME=/root/.cache/huggingface
WORKDIR /runs
CMD ["sdxl-ft", "--help"]
