#!/usr/bin/env bash
# dpo_qwen2_7b: DPO on preference pairs with Qwen2-7B-Instruct on 8 GPUs (TP4 x DP2, no rollout engine).
#
# One machine, 8 GPUs (torchrun, every rank runs `python -m rlhf.main`; PYTHON=... picks the interpreter).  Extra arguments are
# config overrides (key=value), e.g.
#   bash recipes/dpo_qwen2_7b/run_torchrun.sh model.path=/models/Qwen2-7B-Instruct
#   NPROC=<n> bash recipes/dpo_qwen2_7b/run_torchrun.sh      # another number of ranks (a multiple of TP x PP)
# Options of rlhf.main work too: --cfg prints the resolved config, --help lists the recipes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repository root: relative data/output paths start here

NPROC=${NPROC:-8}
# megatron-core: one CUDA connection keeps TP/SP communication ordered with compute.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$NPROC" -m rlhf.main recipe=dpo_qwen2_7b "$@"
