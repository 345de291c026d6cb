# Shared body of every recipes/<name>/run_torchrun.sh (sourced, not run): one machine, NPROC ranks via
# torchrun, each running `python -m rlhf.main recipe=$RECIPE "$@"` from the repository root.
#
# The recipe script sets, then sources this file with its arguments:
#   RECIPE=<name>        the config recipe (recipes/<name>/<name>.yaml)
#   DEFAULT_NPROC=<n>    CPU: ranks when NPROC is not set (a multiple of TP x PP; the rest is data parallel);
#                        GPU: the machine's GPUs when GPUS is not set
#   DEVICE=cpu|gpu       cpu: split the cores between the ranks (OMP_NUM_THREADS);
#                        gpu: CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron-core keeps TP/SP comms ordered)
# GPU: without NPROC, the ranks are what the config leaves of the GPUS GPUs: all of them colocated, those the
# engines do not take with rollout.mode=disaggregated (rollout.num_engines x rollout.tensor_model_parallel_size,
# after the trainer's); `python -m rlhf.main --print-launch=GPUS <the overrides>` says how many, and refuses
# (exit 2, the values and the fix) when the engines leave no GPU for the trainer.
# User knobs: NPROC, GPUS, PYTHON (interpreter), OMP_NUM_THREADS, TOKENIZERS_PARALLELISM.
set -euo pipefail
: "${RECIPE:?set RECIPE=<recipe name> before sourcing recipes/_launch/torchrun.sh}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repository root: relative data/output paths start here

if [ -z "${NPROC:-}" ] && [ "${DEVICE:-cpu}" = gpu ]; then
    launch=$("${PYTHON:-python}" -m rlhf.main --print-launch="${GPUS:-${DEFAULT_NPROC:-1}}" recipe="$RECIPE" "$@") \
        || exit $?
    read -r NPROC ENGINE_GPUS <<< "$launch"
    [[ "${NPROC:-}" =~ ^[1-9][0-9]*$ ]] \
        || { echo "recipes/_launch/torchrun.sh: rlhf.main --print-launch printed '$launch', not RANKS ENGINE_GPUS" >&2; exit 2; }
    if [ "${ENGINE_GPUS:-0}" != 0 ]; then
        echo "[$RECIPE] $NPROC trainer rank(s); GPUs $NPROC.. kept for the disaggregated engines ($ENGINE_GPUS)" >&2
    fi
fi
NPROC=${NPROC:-${DEFAULT_NPROC:-1}}
case "${DEVICE:-cpu}" in
    cpu)
        # CPU / gloo: split the cores between the ranks (no oversubscription), quiet tokenizers.
        # On hosts whose hostname resolves to an unreachable address, also: export GLOO_SOCKET_IFNAME=lo
        CORES=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / NPROC > 0 ? CORES / NPROC : 1 ))}
        ;;
    gpu)
        # megatron-core: one CUDA connection keeps TP/SP communication ordered with compute.
        export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
        ;;
    *)
        echo "recipes/_launch/torchrun.sh: DEVICE=${DEVICE} (recipe $RECIPE): use cpu or gpu" >&2
        exit 2
        ;;
esac
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$NPROC" \
    -m rlhf.main recipe="$RECIPE" "$@"
