"""Several torchrun check scripts in ONE launch: the same gloo processes run them one after another, so the
interpreter start, the torch / megatron-core imports and the process group are paid once per launch instead of
once per script (tests/e2e/conftest.py groups the scripts of the same world size).

    torchrun --nproc_per_node=N tests/support/dist/run_scripts.py --workdir DIR SCRIPT.py [SCRIPT.py ...]

Each script runs as ``__main__`` with the arguments ``--workdir DIR/<script name>``, exactly as its own launch
would run it, except that:

* its ``torch.distributed.destroy_process_group()`` of the default group is deferred to the end of the launch
  (the group is shared; sub-groups are destroyed as asked);
* megatron-core's model-parallel state is reset before each script (each script initialises its own grid);
* process groups are freed once nothing uses them (:func:`free_dropped_groups`): megatron-core's
  ``destroy_model_parallel`` only forgets its groups, and torch keeps every group alive, each gloo group with its
  own transport thread waking every 10 ms (gloo's tcp ``Loop``).  A launch re-initialises megatron ~60 times
  (~17 groups each): left alone, each rank ended with ~3,000 threads, 365 of them runnable at any moment, and the
  SGLang engines of the last scripts booted and generated on what cores those left (the 2-rank launch: 904 s);
* the rank-to-node table of ``parallel.distributed.init_distributed`` is restored before each script (a
  script's ``destroy_distributed()`` clears it);
* the check results of tests/support/dist/checks.py (``RESULTS``) are cleared before each script;
* one Ray session per process: a script's ``ray.init()`` after an earlier script's joins the session that one started
  (a second session in the same process broke the next engine's weight sync: "Broken pipe" on rank 0, its TP peer
  left waiting in the bridge's broadcast), and ``ray.shutdown()`` is deferred to the end of the launch.

Rank 0 prints ``SCRIPT <name> BEGIN`` / ``SCRIPT <name> END`` around each script.  A script that raises, or exits
non-zero, ends the launch with its exit code (the other ranks are then stopped by torchrun), so the CHECK lines
of the scripts after it are missing and their tests fail with the output's tail.  A script that changes the
process for good (e.g. patches a module: tests/support/dist/device_checks.py) must come last.
"""
import argparse
import gc
import os
import runpy
import sys
import threading
import traceback

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch.distributed as dist  # noqa: E402


def run_one(script: str, workdir: str) -> int:
    """Run ``script`` as __main__ with ``--workdir workdir``; returns its exit code (0 when it returned)."""
    saved_argv = sys.argv
    sys.argv = [script, "--workdir", workdir]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved_argv


def share_ray_session():
    """Make ``ray.init`` join the session an earlier script of this launch started (the same arguments: each script
    starts Ray the same way) and ``ray.shutdown`` a no-op; returns the real ``ray.shutdown`` (for the launch's end)."""
    import ray

    init, shutdown = ray.init, ray.shutdown

    def init_once(*args, **kwargs):
        return None if ray.is_initialized() else init(*args, **kwargs)

    ray.init, ray.shutdown = init_once, lambda *args, **kwargs: None
    return shutdown


def free_dropped_groups(ps):
    """Make megatron-core's ``ps.destroy_model_parallel()`` free the process groups nothing uses any more, and
    return ``sweep()``, which does the same (for the end of a script).  A group is freed, and its gloo transport
    thread ended, only once nothing holds it, but torch's own registry (``_world``) holds every group until
    ``destroy_process_group``: after a garbage collection (some holders are reference cycles), every group
    created in this launch that only the registry still holds is destroyed.  A group something still holds
    stays (e.g. a grid parallel.layouts.ParallelLayout keeps aside while megatron runs another).  Everything alive
    at a script's start is frozen out of the collector's view (``gc.freeze``), so the collections stay short."""
    c10d = dist.distributed_c10d
    keep = set(c10d._world.pg_map)  # the default group and what init_distributed made
    destroy_model_parallel = ps.destroy_model_parallel

    def registry_refs(pg) -> int:
        """The references torch's registry holds to ``pg`` (as a key or a value of its tables)."""
        w = c10d._world
        n = 0
        for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag,
                      w.pg_coalesce_state):
            n += (pg in table) + sum(v is pg for v in table.values())
        return n + sum(v is pg for tagged in w.tags_to_pg.values() for v in tagged)

    def sweep():
        gc.collect()
        dropped = [pg for pg in list(c10d._world.pg_map) if pg not in keep]
        # references to each: `dropped`, the loop's `pg`, getrefcount's argument, the registry's
        unused = [pg for pg in dropped if sys.getrefcount(pg) - 3 == registry_refs(pg)]
        del dropped
        for pg in unused:
            dist.destroy_process_group(pg)

    def destroying_model_parallel():
        destroy_model_parallel()
        sweep()

    ps.destroy_model_parallel = destroying_model_parallel
    return sweep


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("scripts", nargs="+")
    args = ap.parse_args()

    from megatron.core import parallel_state as ps

    import parallel.distributed as pd
    from tests.support.dist import checks

    pd.init_distributed()
    sweep_groups = free_dropped_groups(ps)
    rank_nodes = pd._RANK_NODES
    destroy = dist.destroy_process_group

    def deferred_destroy(group=None):  # the default group is shared by every script of the launch
        if group is not None:
            destroy(group)

    dist.destroy_process_group = deferred_destroy
    ray_shutdown = share_ray_session()
    rank0 = dist.get_rank() == 0
    try:
        for script in args.scripts:
            name = os.path.splitext(os.path.basename(script))[0]
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            sweep_groups()  # whatever groups the script before left
            gc.freeze()
            pd._RANK_NODES = rank_nodes
            checks.RESULTS.clear()  # each script's SUMMARY counts its own checks
            dist.barrier()
            if rank0:
                print(f"SCRIPT {name} BEGIN", flush=True)
            try:
                rc = run_one(script, os.path.join(args.workdir, name))
            except Exception:  # noqa: BLE001 - reported, then the launch ends with it
                traceback.print_exc()
                rc = 1
            if rc:
                print(f"SCRIPT {name} FAILED rank {dist.get_rank()} exit {rc}", flush=True)
                return rc
            if rank0:  # (the process's threads: every gloo group holds one)
                print(f"SCRIPT {name} END ({len(dist.distributed_c10d._world.pg_map)} process groups, "
                      f"{threading.active_count()} Python threads, {len(os.listdir('/proc/self/task'))} threads)"
                      if os.path.isdir("/proc/self/task") else f"SCRIPT {name} END", flush=True)
    finally:
        dist.destroy_process_group = destroy
        ray_shutdown()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    dist.barrier()
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
