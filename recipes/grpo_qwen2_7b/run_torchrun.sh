#!/usr/bin/env bash
# grpo_qwen2_7b: GRPO on GSM8K with Qwen2-7B-Instruct, 8 GPUs (TP4 x DP2), no critic, 4 colocated SGLang engines.
#
# One machine, 8 GPUs: torchrun starts the ranks, each running `python -m rlhf.main recipe=grpo_qwen2_7b`
# (shared body: recipes/_launch/torchrun.sh).  Extra arguments are config overrides (key=value), e.g.
#   bash recipes/grpo_qwen2_7b/run_torchrun.sh model.path=<local copy of the model>
#   NPROC=<n> bash recipes/grpo_qwen2_7b/run_torchrun.sh      # another number of ranks (a multiple of TP x PP)
# Options of rlhf.main work too: --cfg prints the resolved config, --help lists the recipes.
RECIPE=grpo_qwen2_7b DEFAULT_NPROC=8 DEVICE=gpu
source "$(dirname "${BASH_SOURCE[0]}")/../_launch/torchrun.sh"
