"""Zero-copy weight sync (CPU, one host): the trainer ranks write straight into the engines' parameters.

Once per engine layout each engine moves its parameters into one shared-memory arena per TP rank
(rlhf.rollout.engine_loader.share_parameters) and reports the arena's file and every parameter's byte offset.
Every trainer rank maps the arenas once; a sync is then the ranks' composed block writes
(engine_layout.compose_writes, the same ops as for buckets, with the arena offsets as the "bucket" layout), done
in parallel straight into the parameters between rollouts (the engines run no forward pass then: their actors run
one call at a time and the rollout manager refuses a sync while it generates), then ONE call per engine, the
commit, which opens a weight-update session, repairs a parameter SGLang moved out of the arena (copying the written
bytes into it; sharing then ends), counts the update, flushes the cache and closes the session.  No bucket buffer,
no copy in the engine, no engine call before the writes.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace

import torch

from rlhf.weight_bridge.bucketing import BucketPlan
from rlhf.weight_bridge.engine_layout import DirectPlan, LayoutUnavailable, write_section_ops
from rlhf.weight_bridge.plan import SendPlan, StagePlan

__all__ = ["arena_plan", "ArenaMaps", "map_arena", "write_shared"]


def arena_plan(plan: DirectPlan, shares: list) -> DirectPlan:
    """``plan`` with each stage's buckets replaced by one "bucket" laid out as the engines' arenas.

    Args:
        shares: per engine, SGLangEngine.share_parameters's ``{"fingerprint", "ranks": [{"manager", "handle",
            "size", "offsets", "dtypes"}]}``.
    Raises:
        LayoutUnavailable: an engine could not share, shared for another layout, or its ranks' arenas are laid out
            differently (the ops address every rank's and engine's arena with one set of offsets).
    """
    errors = [f"engine {i}: {s['error']}" for i, s in enumerate(shares) if s is None or "error" in s]
    if errors:
        raise LayoutUnavailable("; ".join(errors))
    fp = plan.layout.fingerprint
    if any(s["fingerprint"] != fp for s in shares):
        raise LayoutUnavailable(f"engines shared parameters for layouts {sorted({s['fingerprint'] for s in shares})}, "
                                f"the plan is for {fp}")
    ranks = [r for s in shares for r in s["ranks"]]
    first = ranks[0]
    if any(r["offsets"] != first["offsets"] or r["size"] != first["size"] for r in ranks[1:]):
        raise LayoutUnavailable("the engines' TP ranks laid out their shared parameters differently")
    stages = []
    for s in plan.send.stages:
        for m in s.metas:
            if m.name not in first["offsets"] or first["dtypes"][m.name] != str(m.dtype).replace("torch.", ""):
                raise LayoutUnavailable(f"engine parameter {m.name!r} ({m.dtype}) is not in the shared arena as such")
        bucket = BucketPlan(0, list(s.metas), [first["offsets"][m.name] for m in s.metas], int(first["size"]))
        stages.append(StagePlan(s.pp_rank, s.leader, s.metas, [bucket]))
    handles = [[(r["manager"], r["handle"], int(r["size"])) for r in s["ranks"]] for s in shares]
    key = hashlib.sha256(f"{plan.key}|{handles}".encode()).hexdigest()[:20]
    return replace(plan, send=SendPlan(stages, []), key=key, arenas=handles)


def map_arena(handle: str, size: int) -> torch.Tensor:
    """uint8 tensor [size] over the bytes of an engine's arena (SGLangEngine.share_parameters's ``handle`` and
    ``size``), mapped from its file ``/dev/shm<handle>`` without torch's shared-memory manager.

    Why not ``UntypedStorage._new_shared_filename_cpu``: that mapping registers with the engine's
    ``torch_shm_manager`` and tells it again when released; SGLang's shutdown kills the manager with the engine's
    process tree, and a mapping released after that (a trainer rank slower than rank 0 to close) raises
    ``std::system_error`` "Broken pipe" in a C++ destructor, aborting that rank's exit.  The file holds torch's
    reference-count header before the bytes (RefcountedMapAllocator: the file is ``size`` + header long); the
    header's length is read from the file's size, not assumed.

    Raises:
        RuntimeError: no such file here (an engine on another host), or a file size that is not the arena's plus a
            header of at most one page.
    """
    path = "/dev/shm" + handle
    try:
        total = os.path.getsize(path)
    except OSError as e:
        raise RuntimeError(f"engine arena {path} cannot be mapped on this host: {e}") from None
    header = total - size
    if not 0 <= header <= 4096:
        raise RuntimeError(f"engine arena {path} is {total} bytes, expected {size} plus a header of at most 4096")
    storage = torch.UntypedStorage.from_file(path, True, total)
    return torch.empty(0, dtype=torch.uint8).set_(storage, header, (size,))


class ArenaMaps:
    """This trainer rank's mappings of every engine TP rank's shared parameters (kept while the plan is)."""

    def __init__(self):
        self._key = None
        self._maps: list[list[torch.Tensor]] = []

    def open(self, plan: DirectPlan) -> None:
        """Map the arenas of ``plan`` (once per plan; the previous plan's mappings are dropped).  Raises
        RuntimeError when a file cannot be mapped (an engine on another host)."""
        if self._key == plan.key:
            return
        self.close()
        self._maps = [[map_arena(handle, size) for _manager, handle, size in engine] for engine in plan.arenas]
        self._key = plan.key

    def write(self, ops: list, entries, targets) -> None:
        """Run this rank's ops (engine_layout.compose_writes of the arena plan: one "bucket") into the arenas of
        every target engine: each engine TP rank's ops go to that rank's arena."""
        flats = [e.values().view(-1) for e in entries]
        by_rank: dict = {}
        for op in ops[0] if ops else ():
            by_rank.setdefault(op[0], []).append(op)
        for i in targets:
            for e, rank_ops in by_rank.items():
                write_section_ops(rank_ops, self._maps[i][e], 0, flats)

    def close(self) -> None:
        self._maps, self._key = [], None


def write_shared(topo, engines, layout_path, direct, stage, entries, targets, times: dict) -> tuple:
    """One rank's part of a zero-copy sync: every active rank (and expert peer) writes its elements straight into
    the target engines' shared parameters; one flag all_reduce over its TP group (and EP group) tells each stage
    that all of them are done and whether any failed; each stage's leader reports to the controller, which then
    commits the update on every engine, one call each that also opens and closes the engine's session (or closes
    the one the sync opened) -- or, when any rank failed, commits nothing (the sync raises on every rank; the next
    sync rewrites every parameter).

    Args:
        topo, engines, layout_path: the bridge's topology, engines' handle (controller) and EngineLayoutPath.
        direct, stage: the arena plan and this rank's stage of it (None: nothing to write).
        times: the sync's phase timings (``produce``, ``deliver``; ``ended``: engines whose sessions closed).
    Returns:
        (error message or None, engines reached).
    """
    t0 = time.perf_counter()
    error = None
    if stage is not None:
        try:
            layout_path.maps.write(layout_path.ops, entries, targets)
        except Exception as e:  # noqa: BLE001 - reported to the controller, no rank hangs
            error = f"rank {topo.rank}: {type(e).__name__}: {e}"
        # every TP peer (and expert peer) is done, and whether any failed: then nothing is committed
        failed = topo.tp_size > 1 and topo.any_rank(error is not None, topo.tp_group)
        if getattr(topo, "ep_size", 1) > 1:
            failed = topo.any_rank(error is not None or failed, topo.ep_group) or failed
        if failed and error is None:
            error = f"rank {topo.rank}: a tensor- or expert-parallel peer failed its writes (its error follows)"
    times["produce"] += time.perf_counter() - t0
    leaders = [s.leader for s in direct.send.stages if s.leader != topo.controller]
    if not topo.is_controller:
        if topo.is_leader and topo.rank in leaders:
            topo.send_object(error, topo.controller)
        return error, targets
    errors = [error] + [topo.recv_object(r) for r in leaders]
    error = next((e for e in errors if e), None)
    if error is not None:
        return error, targets
    t0 = time.perf_counter()
    try:
        done = engines.wait(engines.commit_shared_writes(direct.layout.fingerprint, engines=targets,
                                                         flush_cache=True, end_session=True), "commit_shared_writes")
        times["ended"] = list(targets)  # their sessions are closed: sync() does not call end_weight_update
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", targets
    finally:
        times["deliver"] += time.perf_counter() - t0
    if any(d and d.get("moved") for d in done):
        layout_path.unshare()  # a new epoch: the next sync plans afresh (and shares again)
    return None, targets
