#!/usr/bin/env bash
# calc_tool_tiny_cpu: GRPO with a calculator tool over multi-turn rollouts, tiny model, CPU, a few minutes.
#
# One machine, 1 process: torchrun starts the ranks, each running `python -m rlhf.main recipe=calc_tool_tiny_cpu`
# (shared body: recipes/_launch/torchrun.sh).  Extra arguments are config overrides (key=value), e.g.
#   bash recipes/calc_tool_tiny_cpu/run_torchrun.sh trainer.total_training_steps=5
#   NPROC=<n> bash recipes/calc_tool_tiny_cpu/run_torchrun.sh      # another number of ranks (a multiple of TP x PP)
# Options of rlhf.main work too: --cfg prints the resolved config, --help lists the recipes.
RECIPE=calc_tool_tiny_cpu DEFAULT_NPROC=1 DEVICE=cpu
source "$(dirname "${BASH_SOURCE[0]}")/../_launch/torchrun.sh"
