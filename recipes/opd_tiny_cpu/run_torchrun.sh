#!/usr/bin/env bash
# opd_tiny_cpu: on-policy distillation: the unwarmed tiny model learns from its warmed-up self, CPU, a few minutes.
#
# One machine, 1 process: torchrun starts the ranks, each running `python -m rlhf.main recipe=opd_tiny_cpu`
# (shared body: recipes/_launch/torchrun.sh).  Extra arguments are config overrides (key=value), e.g.
#   bash recipes/opd_tiny_cpu/run_torchrun.sh trainer.total_training_steps=5
#   NPROC=<n> bash recipes/opd_tiny_cpu/run_torchrun.sh      # another number of ranks (a multiple of TP x PP)
# Options of rlhf.main work too: --cfg prints the resolved config, --help lists the recipes.
RECIPE=opd_tiny_cpu DEFAULT_NPROC=1 DEVICE=cpu
source "$(dirname "${BASH_SOURCE[0]}")/../_launch/torchrun.sh"
