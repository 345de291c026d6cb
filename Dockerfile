# GPU image for training on clusters: CUDA 13 + Python 3.11 + this package with the [gpu] and [agent] extras
# (Transformer Engine for CUDA 13) and its pinned stack (torch 2.14.1 cu130, megatron-core, SGLang, Ray, Hydra).
# Every Python pin comes from setup.py; tests/unit/test_docker_requirements.py resolves the same set on CPU machines.
#
#   docker build -t rlhf-megatron-sglang .
#   docker run --gpus all --ipc=host --shm-size=32g -v $PWD/outputs:/workspace/rlhf/outputs \
#       rlhf-megatron-sglang bash recipes/gsm8k_ppo_qwen2_7b/run_torchrun.sh
#
# The torch wheel bundles its CUDA runtime; the devel base image supplies nvcc and cuDNN headers for
# building Transformer Engine's PyTorch extension.  BASE_IMAGE must stay on CUDA 13 (torch cu130 and the
# core-cu13 extra of transformer-engine in setup.py); pick a 13.x tag your driver supports.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu22.04
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.11 (Ubuntu 22.04 ships it in universe), build tools for TE / SGLang kernels, libnuma for SGLang.
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.11 python3.11-dev python3.11-venv \
        build-essential ninja-build git curl ca-certificates libnuma1 \
    && rm -rf /var/lib/apt/lists/*

RUN python3.11 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN pip install --upgrade pip setuptools wheel

WORKDIR /workspace/rlhf

# 1) Dependencies first (cached while only the source changes): setup.py with an empty package.
#    a) the pinned stack (torch 2.14.1 cu130 first of all);
#    b) the [gpu] extra: Transformer Engine's PyTorch extension is an sdist compiled against the torch of
#       step a), so it is built WITHOUT build isolation (with it, pip would compile against a fresh torch).
COPY setup.py README.md ./
ENV NVTE_FRAMEWORK=pytorch \
    MAX_JOBS=8
RUN mkdir -p rlhf && touch rlhf/__init__.py \
    && pip install . \
    && pip install --no-build-isolation '.[gpu,agent]' \
    && pip uninstall -y rlhf-megatron-sglang \
    && rm -rf rlhf build *.egg-info

# 2) The package itself (editable, so recipes and configs can be edited in a derived image); every
#    dependency is already there.  A conflict fails the build.
COPY . .
RUN pip install --no-build-isolation --no-deps -e '.[gpu,agent]' \
    && pip check \
    && python -c "import os, torch; c = os.environ.get('CUDA_VERSION', '?'); \
assert torch.version.cuda.split('.')[0] == c.split('.')[0], f'torch is CUDA {torch.version.cuda}, the image CUDA {c}'"
