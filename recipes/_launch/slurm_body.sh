# Shared body of every recipes/<name>/run_slurm.sbatch (sourced in the batch step, not run on its own).
#
# The recipe script sets RECIPE=<name>, DEVICE=cpu|gpu and, for CPU recipes, DEFAULT_TASKS_PER_NODE=<n>
# (ranks per node when --ntasks-per-node is not given), then sources this file with the config overrides.
#
# On an allocation of N nodes (node 0 = the first of `scontrol show hostnames $SLURM_JOB_NODELIST`):
#  1. ports come from the job id: base = 20000 + 3 * (SLURM_JOB_ID % 4000); MASTER_PORT = base, the Ray
#     head (GCS) port = base + 1, its client-server port = base + 2 (parallel.distributed.slurm_job_ports
#     computes the same), so two jobs sharing a node never meet;
#  2. MASTER_ADDR and the Ray head address are node 0's NodeAddr (scontrol), resolved to an IPv4 address;
#  3. ONE srun step runs the trainer: tasks per node = the GPUs per node of the allocation (GPU recipes; with
#     rollout.mode=disaggregated, on one node, less the engines' GPUs: `rlhf.main --print-launch`; refused on
#     several nodes) or --ntasks-per-node (CPU recipes), each task `recipes/_launch/slurm_task.sh python -m rlhf.main
#     recipe=$RECIPE "$@"`.  The first task on each node also runs that node's Ray (head on node 0,
#     worker elsewhere) inside the same step, so the trainer ranks and the Ray node (SGLang engines)
#     share the step's GPUs and nothing claims them twice; rank 0 waits until all N Ray nodes have
#     joined and fails the job (exit 1, a clear line) after RAY_JOIN_TIMEOUT seconds (default 300);
#  4. Ray gets a per-job auth token and temp dir and is stopped by pid (never `ray stop`): another job's
#     Ray on the same node is neither joined nor killed.
# Every task's output, Ray's and the engines' (Ray worker logs, prefixed "[ray <node>]") included, goes to
# the job's output file.
#
# Knobs (environment): RAY_JOIN_TIMEOUT, RAY_STOP_WAIT, RAY_TMPDIR (default /tmp), PYTHON (interpreter), REPO_DIR
# (default: the submit directory), EXTRA_SRUN_ARGS (e.g. "--container-image=..." with pyxis).
set -euo pipefail
: "${RECIPE:?set RECIPE=<recipe name> before sourcing recipes/_launch/slurm_body.sh}"

say() { echo "[$RECIPE] $*"; }
fail() { echo "[$RECIPE] ERROR: $*" >&2; exit 1; }

[ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ] \
    || fail "not inside a Slurm allocation: submit with  sbatch recipes/$RECIPE/run_slurm.sbatch [overrides]"
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$REPO_DIR"
export PYTHONPATH=$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}   # this checkout, also in Ray's worker processes

# ---- nodes and addresses
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NNODES=${#NODES[@]}
[ "$NNODES" -ge 1 ] || fail "scontrol show hostnames '$SLURM_JOB_NODELIST' printed no node"
HEAD_NODE=${NODES[0]}
HEAD_ADDR=$(scontrol show node -o "$HEAD_NODE" | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n1)
HEAD_IP=$(getent ahostsv4 "${HEAD_ADDR:-$HEAD_NODE}" | awk 'NR == 1 {print $1}')
[ -n "$HEAD_IP" ] || fail "cannot resolve node $HEAD_NODE (NodeAddr '${HEAD_ADDR}') to an IPv4 address"

PORT_BASE=$(( 20000 + 3 * (SLURM_JOB_ID % 4000) ))
export MASTER_ADDR=$HEAD_IP MASTER_PORT=$PORT_BASE
export RAY_PORT=$(( PORT_BASE + 1 )) RAY_CLIENT_PORT=$(( PORT_BASE + 2 ))
export RAY_ADDRESS=$HEAD_IP:$RAY_PORT
export RLHF_RECIPE=$RECIPE RLHF_SLURM_NODES=${NODES[*]}
# a token of this job's own: no other Ray cluster (another job on the same node) can join or be joined
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
    RAY_AUTH_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
fi
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

# ---- tasks and GPUs per node, from the allocation
case "${DEVICE:-cpu}" in
    gpu)
        GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-}
        if [ -z "$GPUS_PER_NODE" ] && [ -n "${SLURM_GPUS_PER_NODE:-}" ]; then
            GPUS_PER_NODE=${SLURM_GPUS_PER_NODE##*:}   # "8" or "h100:8"
        fi
        if [ -z "$GPUS_PER_NODE" ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
            GPUS_PER_NODE=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
        fi
        [[ "${GPUS_PER_NODE:-}" =~ ^[1-9][0-9]*$ ]] || fail "no GPUs in this allocation" \
            "(SLURM_GPUS_ON_NODE='${SLURM_GPUS_ON_NODE:-}'): submit with --gpus-per-node=<n>, or use a CPU recipe"
        # one trainer rank per GPU, less the GPUs disaggregated engines keep (after the trainer's, rlhf.main says)
        launch=$("${PYTHON:-python}" -m rlhf.main --print-launch="$GPUS_PER_NODE" recipe="$RECIPE" "$@") || exit 2
        read -r TASKS_PER_NODE ENGINE_GPUS <<< "$launch"
        [[ "${TASKS_PER_NODE:-}" =~ ^[1-9][0-9]*$ ]] || fail "rlhf.main --print-launch printed '$launch'"
        if [ "${ENGINE_GPUS:-0}" != 0 ] && [ "$NNODES" -gt 1 ]; then
            fail "rollout.mode=disaggregated on $NNODES GPU nodes: the engines ($ENGINE_GPUS GPUs) take the GPUs" \
                "after all the trainer's (rank r on node r / GPUs per node), but srun starts the same number of" \
                "trainer tasks on every node; submit one node (sbatch -N 1) or use rollout.mode=colocated"
        fi
        STEP_ARGS=(--gpus-per-node="$GPUS_PER_NODE")
        # megatron-core: one CUDA connection keeps TP/SP communication ordered with compute.
        export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
        ;;
    cpu)
        GPUS_PER_NODE=0
        TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-${DEFAULT_TASKS_PER_NODE:-1}}
        STEP_ARGS=()
        # CPU / gloo: one OpenMP pool per task, sized to its CPUs.
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
        ;;
    *)
        fail "DEVICE='${DEVICE}' in recipes/$RECIPE/run_slurm.sbatch: use cpu or gpu"
        ;;
esac
export RLHF_GPUS_PER_NODE=$GPUS_PER_NODE

say "job $SLURM_JOB_ID: nodes ${NODES[*]}; Ray head $RAY_ADDRESS on $HEAD_NODE;" \
    "torch.distributed $MASTER_ADDR:$MASTER_PORT; $TASKS_PER_NODE rank(s) x $NNODES node(s), $GPUS_PER_NODE GPU(s) per node"

# ---- the trainer step (Ray runs inside it, see recipes/_launch/slurm_task.sh)
# shellcheck disable=SC2086  # EXTRA_SRUN_ARGS is a list of options
set +e
srun --nodes="$NNODES" --ntasks-per-node="$TASKS_PER_NODE" --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    ${STEP_ARGS[@]+"${STEP_ARGS[@]}"} --kill-on-bad-exit=1 ${EXTRA_SRUN_ARGS:-} \
    bash "$REPO_DIR/recipes/_launch/slurm_task.sh" "${PYTHON:-python}" -m rlhf.main recipe="$RECIPE" "$@"
rc=$?
set -e
say "trainer exited with $rc"
exit $rc
