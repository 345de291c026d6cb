#!/usr/bin/env bash
# gsm8k_ppo_tiny_cpu: GSM8K PPO plumbing on CPU: real GSM8K data and reward, tiny model, TP2.
#
# One machine, 2 processes: torchrun starts the ranks, each running `python -m rlhf.main recipe=gsm8k_ppo_tiny_cpu`
# (shared body: recipes/_launch/torchrun.sh).  Extra arguments are config overrides (key=value), e.g.
#   bash recipes/gsm8k_ppo_tiny_cpu/run_torchrun.sh trainer.total_training_steps=5
#   NPROC=<n> bash recipes/gsm8k_ppo_tiny_cpu/run_torchrun.sh      # another number of ranks (a multiple of TP x PP)
# Options of rlhf.main work too: --cfg prints the resolved config, --help lists the recipes.
RECIPE=gsm8k_ppo_tiny_cpu DEFAULT_NPROC=2 DEVICE=cpu
source "$(dirname "${BASH_SOURCE[0]}")/../_launch/torchrun.sh"
