#!/usr/bin/env bash
# gpu_smoke: the product path on one GPU: PPO (critic, reference), colocated SGLang with the memory saver, 3 steps.
#
# One machine, 1 GPUs: torchrun starts the ranks, each running `python -m rlhf.main recipe=gpu_smoke`
# (shared body: recipes/_launch/torchrun.sh).  Extra arguments are config overrides (key=value), e.g.
#   bash recipes/gpu_smoke/run_torchrun.sh model.path=<local copy of the model>
#   NPROC=<n> bash recipes/gpu_smoke/run_torchrun.sh      # another number of ranks (a multiple of TP x PP)
# Options of rlhf.main work too: --cfg prints the resolved config, --help lists the recipes.
RECIPE=gpu_smoke DEFAULT_NPROC=1 DEVICE=gpu
source "$(dirname "${BASH_SOURCE[0]}")/../_launch/torchrun.sh"
