#!/usr/bin/env bash
# gsm8k_multiturn_qwen2_5_3b: multi-turn GRPO with the GSM8K tool, Qwen2.5-3B-Instruct, 8 GPUs (TP2 x DP4), 8 engines.
#
# One machine, 8 GPUs: torchrun starts the ranks, each running `python -m rlhf.main recipe=gsm8k_multiturn_qwen2_5_3b`
# (shared body: recipes/_launch/torchrun.sh).  Extra arguments are config overrides (key=value), e.g.
#   bash recipes/gsm8k_multiturn_qwen2_5_3b/run_torchrun.sh model.path=<local copy of the model>
#   NPROC=<n> bash recipes/gsm8k_multiturn_qwen2_5_3b/run_torchrun.sh      # another number of ranks (a multiple of TP x PP)
# Options of rlhf.main work too: --cfg prints the resolved config, --help lists the recipes.
RECIPE=gsm8k_multiturn_qwen2_5_3b DEFAULT_NPROC=8 DEVICE=gpu
source "$(dirname "${BASH_SOURCE[0]}")/../_launch/torchrun.sh"
