#!/usr/bin/env bash
# moe_r3_tiny_cpu: GRPO on a tiny Qwen3-MoE with rollout routing replay (R3), CPU, a few minutes.
#
# One machine, 1 process: torchrun starts the ranks, each running `python -m rlhf.main recipe=moe_r3_tiny_cpu`
# (shared body: recipes/_launch/torchrun.sh).  Extra arguments are config overrides (key=value), e.g.
#   bash recipes/moe_r3_tiny_cpu/run_torchrun.sh trainer.total_training_steps=5
#   NPROC=<n> bash recipes/moe_r3_tiny_cpu/run_torchrun.sh      # another number of ranks (a multiple of TP x PP)
# Options of rlhf.main work too: --cfg prints the resolved config, --help lists the recipes.
RECIPE=moe_r3_tiny_cpu DEFAULT_NPROC=1 DEVICE=cpu
source "$(dirname "${BASH_SOURCE[0]}")/../_launch/torchrun.sh"
