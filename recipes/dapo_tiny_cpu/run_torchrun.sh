#!/usr/bin/env bash
# dapo_tiny_cpu: DAPO (dynamic sampling, decoupled clip, overlong shaping) on the embedded arithmetic task, tiny model, CPU.
#
# One machine, 1 process (torchrun, every rank runs `python -m rlhf.main`; PYTHON=... picks the interpreter).  Extra arguments are
# config overrides (key=value), e.g.
#   bash recipes/dapo_tiny_cpu/run_torchrun.sh trainer.total_training_steps=5
#   NPROC=<n> bash recipes/dapo_tiny_cpu/run_torchrun.sh      # another number of ranks (a multiple of TP x PP)
# Options of rlhf.main work too: --cfg prints the resolved config, --help lists the recipes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repository root: relative data/output paths start here

NPROC=${NPROC:-1}
# CPU / gloo: split the cores between the ranks (no oversubscription), quiet tokenizers.
# On hosts whose hostname resolves to an unreachable address, also: export GLOO_SOCKET_IFNAME=lo
CORES=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$NPROC" -m rlhf.main recipe=dapo_tiny_cpu "$@"
