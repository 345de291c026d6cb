#!/usr/bin/env bash
# One task of the trainer step started by recipes/_launch/slurm_body.sh; runs "$@" (the rank's command).
#
# The first task on each node (SLURM_LOCALID=0) also runs this node's Ray for the job, in the same step
# (so it shares the step's GPUs with the trainer ranks instead of claiming them a second time):
#   node 0:  `ray start --head` on $RAY_PORT; rank 0 waits until every node of the job has joined
#            (recipes/_launch/ray_wait.py, RAY_JOIN_TIMEOUT s) and fails the job with a clear line if not;
#   others:  `ray start --address=$RAY_ADDRESS`; once this node's rank is done, it keeps Ray up until the
#            head stops (rank 0 may still use this node's engines), then stops it.
# Ray runs as `ray start --block` in the background (its processes die with it), in a temp dir of this job
# and node, and is stopped by its pid: never `ray stop`, which kills every Ray of the user on the node.
# Ray's worker logs (the SGLang engine actors) are streamed into the job output, prefixed "[ray <node>]".
set -uo pipefail

node=${SLURMD_NODENAME:-$(hostname -s)}
say() { echo "[${RLHF_RECIPE:-rlhf} $node] $*"; }

say "rank ${SLURM_PROCID:-0}/${SLURM_NTASKS:-1} (local ${SLURM_LOCALID:-0}) on $node"
if [ "${SLURM_LOCALID:-0}" != 0 ]; then
    exec "$@"
fi

ray_tmp=${RAY_TMPDIR:-/tmp}/rlhf-ray-${SLURM_JOB_ID}-$node
rm -rf "$ray_tmp"
ray_args=(--temp-dir="$ray_tmp" --node-name="$node" --num-cpus="${SLURM_CPUS_ON_NODE:-1}"
          --num-gpus="${SLURM_GPUS_ON_NODE:-${RLHF_GPUS_PER_NODE:-0}}" --dashboard-agent-listen-port=0
          --disable-usage-stats --block)
# its own session (setsid): stop_ray can end every process of this Ray, agents and engines included, by
# process group; no draining on SIGTERM (a batch job has nothing to hand over)
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
# `ray start --block`, started again (RAY_START_TRIES times at most, default 3) when it gave up before its
# runtime started: Ray waits a fixed 30 s for a raylet to register, which a loaded node can exceed
ray_block() {
    trap ':' TERM   # stop_ray signals the whole group: `ray start` shuts down, then this loop ends
    local try
    for try in $(seq "${RAY_START_TRIES:-3}"); do
        ray start "$@" 2>&1 | tee "$ray_tmp.start"
        grep -q "Ray runtime started" "$ray_tmp.start" && return 0
        echo "ray start gave up before its runtime started (try $try of ${RAY_START_TRIES:-3})"
        sleep 2
    done
    return 1
}
export -f ray_block
export ray_tmp
if [ "${SLURM_NODEID:-0}" = 0 ]; then
    setsid bash -c 'ray_block "$@"' ray_block --head --node-ip-address="${RAY_ADDRESS%:*}" --port="$RAY_PORT" \
        --ray-client-server-port="$RAY_CLIENT_PORT" --include-dashboard=false "${ray_args[@]}" \
        > >(sed -u "s|^|[ray $node] |") 2>&1 &
else
    # a worker started before the head's GCS listens gives up: wait for its port (RAY_JOIN_TIMEOUT s at most;
    # rank 0's join check reports a node that never came)
    for _ in $(seq "${RAY_JOIN_TIMEOUT:-300}"); do
        (exec 3<>"/dev/tcp/${RAY_ADDRESS%:*}/${RAY_ADDRESS##*:}") 2>/dev/null && break
        sleep 1
    done
    setsid bash -c 'ray_block "$@"' ray_block --address="$RAY_ADDRESS" "${ray_args[@]}" \
        > >(sed -u "s|^|[ray $node] |") 2>&1 &
fi
ray_pid=$!   # = its process group id

stop_ray() {   # TERM, up to 15 s to shut down, then KILL whatever is left in its process group
    local rc=$?
    kill -TERM -- "-$ray_pid" 2>/dev/null
    for _ in $(seq 15); do
        kill -0 "$ray_pid" 2>/dev/null || break
        sleep 1
    done
    kill -KILL -- "-$ray_pid" 2>/dev/null
    rm -f "$ray_tmp.start"
    if [ "$rc" = 0 ]; then
        rm -rf "$ray_tmp"   # its worker logs are in the job output already
    else
        say "Ray's logs of this node: $ray_tmp/session_latest/logs"
    fi
    return 0
}
trap stop_ray EXIT
trap 'exit 143' TERM INT

follow_worker_logs() {   # new files appear as Ray starts worker processes
    local logs=$ray_tmp/session_latest/logs f
    declare -A seen=()
    while kill -0 "$ray_pid" 2>/dev/null; do
        for f in "$logs"/worker-*.out "$logs"/worker-*.err; do
            [ -f "$f" ] && [ -z "${seen[$f]:-}" ] || continue
            seen[$f]=1
            tail -n +1 -F --pid="$ray_pid" "$f" 2>/dev/null | sed -u "s|^|[ray $node] |" &
        done
        sleep 2
    done
}
follow_worker_logs &

if [ "${SLURM_PROCID:-0}" = 0 ]; then
    # shellcheck disable=SC2086  # RLHF_SLURM_NODES is a space-separated list
    "$1" "$(dirname "${BASH_SOURCE[0]}")/ray_wait.py" --address "$RAY_ADDRESS" --nodes ${RLHF_SLURM_NODES:-$node} \
        --timeout "${RAY_JOIN_TIMEOUT:-300}" --watch-pid "$ray_pid" || exit 1
fi

"$@"
rc=$?

if [ "${SLURM_NODEID:-0}" != 0 ] && [ "$rc" = 0 ]; then
    # keep serving until the head is gone (rank 0 stops it when done), at most RAY_STOP_WAIT s
    head_host=${RAY_ADDRESS%:*} head_port=${RAY_ADDRESS##*:}
    for _ in $(seq "${RAY_STOP_WAIT:-3600}"); do
        (exec 3<>"/dev/tcp/$head_host/$head_port") 2>/dev/null || break
        sleep 1
    done
fi
exit $rc
