# syntax=docker/dockerfile:1.7
#
# MSN images, one multi-stage file. Build a target with:
#
#   docker build --target serve     -t msn:0.1.0-serve     .   # slim: onnxruntime + faiss-cpu, no torch
#   docker build --target serve-gpu -t msn:0.1.0-serve-gpu .   # CUDA 13: onnxruntime-gpu, faiss-gpu-cuvs
#   docker build --target train     -t msn:0.1.0-train     .   # CUDA torch 2.13.0, train + viz extras
#
# Versions are pinned here (base image tags, onnxruntime-gpu, faiss-gpu-cuvs) and in constraints.txt (torch).
# serve-gpu holds one CUDA major, 13, as its base does: onnxruntime-gpu 1.31.x on PyPI is built for CUDA 13 + cuDNN 9
# (its `cuda` and `cudnn` extras bring those as nvidia-* wheels) and faiss-gpu-cuvs is FAISS' CUDA 13 build.
# torch 2.13.0 on PyPI brings its own CUDA 13 libraries as nvidia-* wheels, so the train target needs no CUDA base
# image, only an NVIDIA driver >= 580 on the host.
# What all three share is written once: deploy/docker/base.sh (interpreter, user msn with UID 10001, /opt/venv) runs
# on each base image, and each target installs its extras straight into /opt/venv from a read-only view of the
# `source` stage, so no source tree or build leftover stays in an image.
# This file is linted by hadolint in tests/deploy/test_dockerfile.py; no image was built on the development machines
# (no Docker engine there): see docs/deploy.md.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

# --------------------------------------------------------------------------------------------------------------------
# Source: only what `pip install .` needs (.dockerignore is an allow-list too). Targets mount it, never copy it.
FROM ${PYTHON_IMAGE} AS source
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY msn_core/ msn_core/
COPY training/ training/
COPY msn_serve/ msn_serve/
COPY visualizer/ visualizer/
COPY configs/ configs/

# --------------------------------------------------------------------------------------------------------------------
# Bases: the two base images, each prepared by the same script. serve and train stand on the slim Python image;
# serve-gpu on the CUDA 13 + cuDNN 9 runtime with the distribution's Python (3.12 on Ubuntu 24.04).
FROM ${PYTHON_IMAGE} AS python-base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN --mount=type=bind,source=deploy/docker/base.sh,target=/tmp/base.sh sh /tmp/base.sh

FROM ${CUDA_IMAGE} AS cuda-base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN --mount=type=bind,source=deploy/docker/base.sh,target=/tmp/base.sh sh /tmp/base.sh

# --------------------------------------------------------------------------------------------------------------------
# serve: CPU serving image. `pip install .[serve]` alone: no torch, so the image stays small.
FROM python-base AS serve
ARG MSN_VERSION=0.1.0
LABEL org.opencontainers.image.title="msn-serve" \
      org.opencontainers.image.description="Masked Siamese Networks embedding service (ONNX Runtime, CPU, no torch)" \
      org.opencontainers.image.version="${MSN_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
WORKDIR /src
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    pip install --no-cache-dir -c constraints.txt ".[serve]" \
    && python -c "import msn_core, msn_serve, onnxruntime, faiss; print('onnxruntime', onnxruntime.__version__)" \
    && if python -c "import torch" 2>/dev/null; then echo "torch leaked into the serve image" >&2; exit 1; fi \
    && install -d -o msn -g msn /data && install -d /models
ENV MSN_SERVE_HOST=0.0.0.0 \
    MSN_SERVE_PORT=8000 \
    MSN_SERVE_BUNDLE=/models/bundle \
    MSN_SERVE_DATA_DIR=/data \
    MSN_SERVE_DEVICE=cpu \
    MSN_SERVE_HTTP_WORKERS=auto
USER 10001:10001
WORKDIR /home/msn
EXPOSE 8000
# Liveness only (the process answers HTTP); readiness after warm-up is /readyz, used by Kubernetes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('MSN_SERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["msn-serve"]

# --------------------------------------------------------------------------------------------------------------------
# serve-gpu: onnxruntime-gpu with its CUDA 13 and cuDNN 9 wheels, and faiss-gpu-cuvs (CUDA 13, with cuVS, RAFT and
# the CUDA 13 cuBLAS/cuSOLVER/cuSPARSE/NCCL wheels); one CUDA major, on an R580+ driver. No nvidia-*-cu12 wheel.
FROM cuda-base AS serve-gpu
ARG MSN_VERSION=0.1.0
ARG ONNXRUNTIME_GPU_VERSION=1.31.1
ARG FAISS_GPU_CUVS_VERSION=1.15.1
LABEL org.opencontainers.image.title="msn-serve-gpu" \
      org.opencontainers.image.description="Masked Siamese Networks embedding service (ONNX Runtime and FAISS, CUDA 13)" \
      org.opencontainers.image.version="${MSN_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
WORKDIR /src
# The gpu extra is the whole serving install with the GPU builds of onnxruntime and faiss instead of the CPU ones
# (same modules: never both). faiss itself is not imported here: its GPU build needs the driver, which a build lacks.
# The checks: no other build of either module (the CPU ones, or faiss-gpu, the CUDA 12 build) and no CUDA 12 wheel.
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    pip install --no-cache-dir -c constraints.txt ".[gpu]" "onnxruntime-gpu[cuda,cudnn]==${ONNXRUNTIME_GPU_VERSION}" \
        "faiss-gpu-cuvs==${FAISS_GPU_CUVS_VERSION}" \
    && if pip show onnxruntime faiss-cpu faiss-gpu >/dev/null 2>&1; then echo "another onnxruntime/faiss build leaked into serve-gpu" >&2; exit 1; fi \
    && python -c "import importlib.metadata as m, sys; cu12 = sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].lower().endswith('-cu12')); sys.exit(f'CUDA 12 wheels in serve-gpu: {cu12}' if cu12 else 0)" \
    && python -c "import onnxruntime as ort; p = ort.get_available_providers(); print(p); assert 'CUDAExecutionProvider' in p" \
    && if python -c "import torch" 2>/dev/null; then echo "torch leaked into the serve-gpu image" >&2; exit 1; fi \
    && install -d -o msn -g msn /data && install -d /models
ENV MSN_SERVE_HOST=0.0.0.0 \
    MSN_SERVE_PORT=8000 \
    MSN_SERVE_BUNDLE=/models/bundle \
    MSN_SERVE_DATA_DIR=/data \
    MSN_SERVE_DEVICE=cuda \
    MSN_SERVE_HTTP_WORKERS=auto
USER 10001:10001
WORKDIR /home/msn
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('MSN_SERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["msn-serve"]

# --------------------------------------------------------------------------------------------------------------------
# train: torch 2.13.0 from PyPI (the Linux x86_64 wheel there is the CUDA 13 build; its CUDA/cuDNN/NCCL libraries
# come as nvidia-* wheels, so no CUDA base image), the train and viz extras, the training scripts and configs under
# /workspace.
FROM python-base AS train
ARG MSN_VERSION=0.1.0
LABEL org.opencontainers.image.title="msn-train" \
      org.opencontainers.image.description="Masked Siamese Networks pretraining, evaluation, export and visualizer (torch 2.13.0, CUDA)" \
      org.opencontainers.image.version="${MSN_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
WORKDIR /src
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    pip install --no-cache-dir -c constraints.txt ".[train,viz]" \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    && install -d -o msn -g msn /workspace/runs /workspace/bundles
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HF_HUB_OFFLINE=1 \
    GRADIO_ANALYTICS_ENABLED=False \
    MPLCONFIGDIR=/tmp/matplotlib
COPY --from=source /src/training /workspace/training
COPY --from=source /src/configs /workspace/configs
USER 10001:10001
WORKDIR /workspace
# Training jobs have no HTTP endpoint; the visualizer's check lives in deploy/compose.yaml.
HEALTHCHECK NONE
CMD ["torchrun", "--help"]
