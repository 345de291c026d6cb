# GPU image for training on clusters: CUDA + Python 3.11 + this package with the [gpu] extra
# (Transformer Engine) and its pinned stack (torch 2.14.1 cu130, megatron-core, SGLang, Ray, Hydra).
#
#   docker build -t rlhf-megatron-sglang .
#   docker run --gpus all --ipc=host --shm-size=32g -v $PWD/outputs:/workspace/rlhf/outputs \
#       rlhf-megatron-sglang bash recipes/gsm8k_ppo_qwen2_7b/run_torchrun.sh
#
# The torch wheel bundles its CUDA runtime; the devel base image supplies nvcc and cuDNN headers for
# building Transformer Engine's PyTorch extension.  Override BASE_IMAGE to match your driver.
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

# 1) Dependencies first (cached while only the source changes): setup.py with empty packages.
COPY setup.py README.md ./
RUN mkdir -p rlhf && touch rlhf/__init__.py \
    && pip install . \
    && pip uninstall -y rlhf-megatron-sglang \
    && rm -rf rlhf parallel build *.egg-info

# 2) Transformer Engine builds its PyTorch extension against the installed torch (no build isolation).
ENV NVTE_FRAMEWORK=pytorch \
    MAX_JOBS=8
RUN pip install --no-build-isolation "transformer-engine[pytorch]>=2.4"

# 3) The package itself (editable, so recipes and configs can be edited in a derived image).
COPY . .
# (steps 1-2 installed every dependency, the [gpu] extra included, so this adds only the package)
RUN pip install --no-build-isolation -e '.[gpu]' && (pip check || echo "pip check reported conflicts (above)")
