"""WeightBridge: stream the actor's megatron weights into the rollout engines after each update.

Per :meth:`WeightBridge.sync` (a collective over every trainer rank):

1. **Plan** (plan.py): every stage leader lists the HF tensors its chunks convert to (converter on meta
   tensors) and reports them to the controller (global rank 0, the only rank holding the engines'
   handle), which validates EVERY name and shape against the engines' expected weights (validate.py)
   and splits the stream into buckets.  The plan is cached: later syncs only compare the reports and the
   engines' fingerprint (a replaced engine, another model) and re-plan when they changed.  A mismatch
   raises WeightBridgeError on every rank; nothing has been sent.  Steady state (steady.py): when no rank's
   inputs and not the engines changed since the last successful sync, one small tensor all_gather of digests
   replaces the reports and the verdict, and the engines' sessions open while the ranks list their tensors.
2. **Stream**: buckets laid out as SGLang's ``FlattenedTensorBucket``, in the engine dtype.  On CPU with
   every TP rank of a stage on one host (shm_buckets.py), each rank copies its own shard into its regions
   of a persistent shared-memory bucket, in parallel: gather + convert + pack is ONE copy, and the engine
   maps that same memory.  Otherwise (hf_stream.py) the TP group gathers each parameter on the stage leader,
   which converts it (q/k/v and gate/up split, padded vocab trimmed) and packs it.  Extra memory: one bucket
   (two with ``overlap``), plus one gathered parameter and its converted copy on the gather path.
3. **Deliver**: ``"tensor"`` (colocated, from_tensor.py: serialized bucket handles, bytes only; on the gather
   path each engine TP rank's handle is of a copy held by the trainer rank on its device, every pipeline stage's
   buckets included, local_handles.py) or
   ``"distributed"`` (disaggregated, from_distributed.py: one flat broadcast per bucket), inside
   ``begin_weight_update`` / ``end_weight_update`` on every engine; the KV/radix cache is flushed once
   per sync, by the last bucket's update call.
4. **Fresh engines**: the engines' handle learns which engines the sync reached (``begin_sync`` /
   ``end_sync``); an engine replaced during the sync stays stale and is synced again by the caller.

SGLang slices its own TP shards out of the full HF tensors, so the bridge is independent of the rollout
TP size.  Engine-layout path (the default, ``engine_layout=True``; engine_layout.py / direct_path.py): with the
shared buckets and the tensor transport, the ranks of each pipeline stage write straight into each engine TP rank's
parameter layout (derived once per engine from its own loaders) and the engine copies each parameter once;
otherwise, with the reason logged once and counted (``SyncStats.fallback_syncs``), the generic path above
(benchmarks/README.md, "Engine-layout path").
Tied embeddings: only ``model.embed_tokens.weight`` is sent.  Persistent buffers that map to an
HF name (standard map or a ``name_map`` hook, :func:`regex_name_map`) are sent; unmapped buffers are
skipped and listed in ``SyncStats.skipped_buffers``; an unmapped parameter is an error.

The engines' handle (``engines``) is an :class:`rlhf.rollout.engine.EngineFleet` (the rollout manager, or a
test double): its methods carry SGLang's names (``begin_weight_update``, ``update_weights_from_tensor``,
``update_weights_from_distributed``, ...) and are called as methods.

Typical use (every trainer rank)::

    bridge = WeightBridge(actor.chunks, actor.spec, rollout_manager if dist.get_rank() == 0 else None)
    optimizer.step(); stats = bridge.sync()
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from parallel.convert import unwrap_model
from parallel.model_config import HFModelSpec
from rlhf.rollout.engine import EngineFleet
from rlhf.weight_bridge.bucketing import (DEFAULT_BUCKET_BYTES, NO_POOL, BufferPool, MemoryMeter, dtype_from_any,
                                          dtype_name)
from rlhf.weight_bridge.check import sample_rows, verify
from rlhf.weight_bridge.direct_path import EngineLayoutPath
from rlhf.weight_bridge.from_distributed import DistributedTransport
from rlhf.weight_bridge.from_tensor import DirectTransport, TensorTransport, prepare_sharing
from rlhf.weight_bridge.hf_stream import hf_stream, stage_buckets
from rlhf.weight_bridge.local_handles import BucketHolder, broadcast_group, holder_ranks, serving_plan
from rlhf.weight_bridge.plan import NameMap, build_send_plan, plan_local_tensors, refuse_report_errors, sync_entries
from rlhf.weight_bridge.shared_params import write_shared
from rlhf.weight_bridge.shm_buckets import SharedBuckets
from rlhf.weight_bridge.sync_stats import SyncStats
from rlhf.weight_bridge.steady import (GO_BEGUN, GO_FAILED, GO_NONE, GO_OPENED, PlanCache, close_early, digest,
                                      needs_sessions, open_sessions)
from rlhf.weight_bridge.topology import MegatronTopology
from rlhf.weight_bridge.validate import WeightBridgeError, normalize_expected

__all__ = ["WeightBridge", "SyncStats"]


class WeightBridge:
    """Streams the actor's weights from megatron chunks into the rollout engines (see module docstring).

    Construct on EVERY trainer rank with the same arguments except ``engines``, which only the controller
    (global rank 0) passes.

    Args:
        model_chunks: this rank's GPTModel chunks (DDP/Float16Module wrappers are fine).
        spec: the HFModelSpec of the model.
        engines: the engines' handle on the controller, None elsewhere.
        transport: ``"tensor"`` (colocated) or ``"distributed"`` (disaggregated broadcast).
        bucket_bytes: memory of the bucket buffers (default 512 MiB; two buffers of half of it with ``overlap``);
            a larger single tensor gets a bucket of its own.
        dtype: dtype sent; None = each weight's dtype in the engines' expected weights.
        overlap: two buffers: bucket k+1 is written while the engines load bucket k (default); False: one.
        name_map: hook mapping extra megatron names (e.g. persistent buffers) to HF tensors.
        check: None, ``"sample"`` (first and last layer and all non-layer tensors) or ``"all"``: read sent
            tensors back (check.py); a mismatch raises WeightBridgeError.
        check_rows: rows per tensor read back.
        allow_missing: predicate on engine weight names that may stay unsent.
        group_prefix, backend, master_address, timeout_s: distributed transport settings (backend None:
            nccl with CUDA, else gloo; master_address None: each stage leader's outward interface address).
        shared_buckets: None (auto: CPU with every TP rank of a stage on one host), True or False: each TP rank
            writes its shard straight into a shared bucket (shm_buckets.py) instead of a gather on the leader.
        topology: override (tests: a simulated TP group); default MegatronTopology().
        engine_layout: write buckets in the engines' own parameter layout (engine_layout.py: derived once per
            engine from its own loaders; the engine copies each parameter once) when the engines, the transport
            and the topology allow it (default); otherwise SGLang's generic loading (reason logged once, counted in
            ``SyncStats.fallback_syncs``); False: always the generic loading, nothing counted.
        zero_copy: on the engine-layout path, have the engines share their parameters (CPU, one host) and write
            straight into them (shared_params.py; default); False, or when they cannot: engine-layout buckets.
        local_handles: colocated (``"tensor"``, the leaders' gather path, no expert parallelism): each engine TP
            rank loads from the trainer rank on its own device, which holds a copy of each bucket of every stage
            (local_handles.py; default); False: every engine rank maps the stage leaders' buckets.
    Raises:
        ValueError: bad arguments, or ``engines`` given on a rank other than the controller (or missing there).
    """

    def __init__(self, model_chunks, spec: HFModelSpec, engines: EngineFleet | None = None, *,
                 transport: str = "tensor", bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype=None, overlap: bool = True,
                 name_map: NameMap | None = None, check: str | None = None, check_rows: int = 4,
                 allow_missing: Callable[[str], bool] | None = None, group_prefix: str = "weight_sync",
                 backend: str | None = None, master_address: str | None = None, timeout_s: float = 1800.0,
                 shared_buckets: bool | None = None, topology=None, engine_layout: bool = True,
                 local_handles: bool = True, zero_copy: bool = True):
        if transport not in ("tensor", "distributed"):
            raise ValueError(f"transport={transport!r}: use 'tensor' (colocated) or 'distributed' (broadcast)")
        if check not in (None, "sample", "all"):
            raise ValueError(f"check={check!r}: use None, 'sample' or 'all'")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        self.chunks, self.spec = list(model_chunks), spec
        self.topo = topology if topology is not None else MegatronTopology()
        if self.topo.is_controller != (engines is not None):
            raise ValueError(f"the engines' handle goes to global rank {self.topo.controller} and only there "
                             f"(rank {self.topo.rank} got {'one' if engines is not None else 'none'})")
        self.engines, self.transport = engines, transport
        self.overlap = overlap
        self.bucket_bytes = max(1, int(bucket_bytes) // 2) if overlap else int(bucket_bytes)  # per buffer
        self.dtype = None if dtype is None else dtype_from_any(dtype)
        self.name_map, self.check, self.check_rows, self.allow_missing = name_map, check, int(check_rows), allow_missing
        self.device = next((p.device for c in self.chunks for p in unwrap_model(c).parameters()), torch.device("cpu"))
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.dist = DistributedTransport(self.topo, engines, group_prefix, backend, master_address, timeout_s)
        self.meter = MemoryMeter()
        self._pool: BufferPool | None = None
        self.shared_buckets = shared_buckets
        self._shared_state = None  # SharedBuckets, or False when not usable
        self._one_host = False  # this TP group is on one host with CPU tensors (known once _shared ran)
        self._local: tuple | None = None  # (key, planned tensors) of this rank
        self._plan_cache: tuple | None = None  # controller: (key, SendPlan)
        self._holder_groups: dict = {}  # member ranks -> broadcast group of the engine-local handles
        self._tp_known: dict | None = None  # member ranks -> tensor-parallel group (self._tp_groups)
        self._ready = False
        self.version = 0
        self.engine_layout, self.local_handles = bool(engine_layout), bool(local_handles)
        self.layout_path = EngineLayoutPath(self.engine_layout, bool(zero_copy))
        self._steady = PlanCache()  # the last successful sync's verdict, reused while nothing changed (steady.py)
        self._digest = 0  # this rank's last plan inputs, hashed (_local_digest)
        self._open_seconds = 0.0  # controller, this sync: waiting for the engines' sessions to open

    # ---- planning -----------------------------------------------------------------------------
    def _report(self, entries, shared: bool) -> dict | None:
        if not self.topo.is_leader:
            return None
        key = tuple((e.local_name, tuple(e.tensor.shape), e.tensor.dtype) for e in entries)
        if self._local is None or self._local[0] != key:
            tensors = [(n, s, dtype_name(d)) for n, s, d in plan_local_tensors(entries, self.spec, self.topo.tp_size,
                                                                                 getattr(self.topo, "ep_size", 1))]
            self._local = (key, tensors)
        rep = {"pp_rank": self.topo.pp_rank, "rank": self.topo.rank, "tensors": self._local[1], "shared": shared}
        if self.transport == "distributed":
            rep["group"] = self.dist.report()
        return rep

    def _controller(self, reports: list, engines: Sequence[int] | None) -> dict:
        """Plan (or reuse the cached plan), open the engines' sessions; the verdict every rank receives."""
        fp = self.engines.fingerprint()
        key = (fp, tuple((r["pp_rank"], r["rank"], tuple(map(tuple, r["tensors"]))) if r and "tensors" in r
                         else repr(r) for r in reports))
        replanned = self._plan_cache is None or self._plan_cache[0] != key
        if replanned:
            expected = normalize_expected(self.engines.expected_weights())
            plan = build_send_plan(reports, self.topo.controller, expected, self.spec, bucket_bytes=self.bucket_bytes,
                                   dtype=self.dtype, check=self.check, allow_missing=self.allow_missing)
            self._plan_cache = (key, plan)
        plan = self._plan_cache[1]
        targets = self._targets(engines)
        groups = None
        if self.transport == "distributed" and self.dist.fingerprint != fp:
            groups = {r["pp_rank"]: r["group"] for r in reports if r}
        direct, reason = self.layout_path.verdict(plan, reports, fp, self.engines, self.transport, self.check,
                                                  self.bucket_bytes)
        holders = None  # {pp_rank: {(engine, engine TP rank): trainer rank serializing that entry}}
        if (self.local_handles and self.transport == "tensor" and direct is None
                and getattr(self.topo, "ep_size", 1) == 1 and not any(r.get("shared_buckets") for r in reports if r)):
            holders = {}
            for stage in plan.stages:
                held = holder_ranks(self.engines.num_engines, self.engines.tp_size, self.topo.world, stage.leader)
                if any(r != stage.leader for r in held.values()):
                    holders[stage.pp_rank] = held
            holders = holders or None
        return {"plan": plan, "targets": targets, "groups": groups, "fingerprint": fp, "replanned": replanned,
                "tp_size": self.engines.tp_size, "direct": direct, "direct_reason": reason, "holders": holders}

    def _targets(self, engines) -> list[int]:
        """Controller: the engines a sync reaches."""
        everyone = list(range(self.engines.num_engines))
        return everyone if engines is None or self.transport == "distributed" else sorted(set(engines))

    def _controller_inputs(self, engines) -> tuple:
        """Controller: what a plan depends on besides the ranks' reports (steady.py digests it)."""
        return self.engines.fingerprint(), tuple(self._targets(engines)), self.layout_path.epoch

    def _plan(self, engines, opening: dict | None = None):
        """Every rank: ``(verdict, entries, skipped)`` of this sync.  Steady state (steady.py): one tensor
        all_gather of the ranks' digests and every rank reuses the last successful sync's verdict; otherwise the
        reports go to the controller, which plans (or reuses its cached plan) and broadcasts the verdict.
        ``opening`` (controller, sync only; an empty dict in): ``{"inputs"}`` out, and ``{"token", "pending",
        "error"}`` when it started opening the engines' sessions before the exchange (its own inputs predicted
        reuse); ``verdict["opened"]`` says so.  Whatever raises on one rank before the exchange (the controller's
        inputs, a rank's listing) makes it send ok=0 and an error report: every rank then takes the fresh path and
        raises WeightBridgeError with that message, none is left waiting in a collective."""
        if not self._ready:
            self.topo.init_collective()
            self._ready = True
        topo = self.topo
        inputs, early, errors = None, False, []
        if opening is not None:
            try:
                opening["inputs"] = inputs = self._controller_inputs(engines)
                early = self._steady.predicts_reuse(topo.rank, digest((self._local_digest(), inputs)))
                if early:  # the engines' begins run while this rank lists its tensors (zero copy: none to run)
                    opening["sessions"] = needs_sessions(self._steady.verdict)
                    opening["token"] = self.engines.begin_sync()
                    try:
                        opening["pending"] = (self.engines.start_weight_update(engines=list(inputs[1]))
                                              if opening["sessions"] else [])
                    except Exception as e:  # noqa: BLE001 - open_sessions reports it (codes: every rank)
                        opening["pending"] = e
            except Exception as e:  # noqa: BLE001 - reported through the exchange so no rank hangs
                early = False
                errors.append(f"rank {topo.rank}: {type(e).__name__}: {e}")
        entries, skipped, report = None, [], None
        try:
            entries, skipped = sync_entries(self.chunks, self.spec, self.name_map, topo)
        except Exception as e:  # noqa: BLE001 - reported through the controller so no rank hangs
            errors.append(f"rank {topo.rank}: {type(e).__name__}: {e}")
        decides_shared = topo.active and self._shared_state is None
        try:
            # collective over the TP group, once: a rank whose listing failed takes part too (the group is then
            # not usable, and decides again at the next sync, below)
            sb = topo.active and self._shared(entries) is not None
            if not errors:
                report = self._report(entries, self.engine_layout and self.transport == "tensor" and sb)
                if report is not None:
                    report["shared_buckets"] = sb
                    report["one_host_cpu"] = self._one_host
                mine = digest((self._local_digest(entries, report), inputs))
        except Exception as e:  # noqa: BLE001 - reported through the controller so no rank hangs
            errors.append(f"rank {topo.rank}: {type(e).__name__}: {e}")
        ok = int(not errors)
        if errors:
            entries, skipped, report, mine = [], [], {"error": "; ".join(errors)}, 0
        go = GO_NONE
        if early:
            opening["token"], opening["error"], waited = open_sessions(self.engines, list(inputs[1]), opening["token"],
                                                                       opening["pending"], opening["sessions"])
            self._open_seconds += waited
            go = GO_FAILED if opening["error"] is not None else GO_OPENED if opening["sessions"] else GO_BEGUN
        codes = topo.all_gather_codes([mine, ok, go])
        if decides_shared and not all(c[1] for c in codes):
            # a rank that could not list its tensors counted as "not usable" in its TP group's one-time decision: the
            # group decides again at the next sync (the codes are the same everywhere, so every TP peer resets too)
            if self._shared_state:
                self._shared_state.close()
            self._shared_state, self._one_host = None, False
        verdict = self._steady.decide(codes)
        go = codes[topo.controller][2]  # every rank knows whether the sessions are open
        if go == GO_FAILED:  # the sessions could not be opened: nothing is written
            self._steady.drop()
            raise topo.broadcast_object(opening["error"] if topo.is_controller else None)
        if verdict is not None:
            verdict["opened"] = go
            return verdict, entries, skipped
        reports = topo.all_gather_object(report)
        verdict = None
        if topo.is_controller:
            try:
                refuse_report_errors(reports)  # before the controller's own inputs, which may be what failed
                verdict = self._controller(reports, engines)
            except Exception as e:  # noqa: BLE001 - every rank must learn about it
                verdict = e if isinstance(e, WeightBridgeError) else WeightBridgeError(f"{type(e).__name__}: {e}")
        verdict = topo.broadcast_object(verdict)
        if isinstance(verdict, BaseException):
            raise verdict
        verdict["opened"] = go
        plan, groups = verdict["plan"], {}
        for stage in plan.stages:  # collective over every rank (torch's new_group), once per member set, in order
            held = (verdict["holders"] or {}).get(stage.pp_rank)
            if held is not None:
                members = tuple(sorted({stage.leader, *held.values()}))
                if members not in self._holder_groups:
                    self._holder_groups[members] = broadcast_group(members, self.topo.world, self._tp_groups())
                groups[stage.pp_rank] = self._holder_groups[members]
        verdict["serving"] = serving_plan({s.pp_rank: s.leader for s in plan.stages}, verdict["holders"], groups)
        self.layout_path.receive(verdict, entries, self.topo, self.spec)
        self._steady.planned(verdict)
        return verdict, entries, skipped

    def _local_digest(self, entries=None, report=None) -> int:
        """This rank's inputs to a plan (its tensors' names, shapes, dtypes and its report), hashed; with no
        arguments the digest of the last ones (the controller's prediction before it lists its tensors)."""
        if entries is not None:
            key = tuple((e.local_name, tuple(e.tensor.shape), e.tensor.dtype) for e in entries)
            # the tensors are in the key; a distributed stage's fresh rendezvous port matters only when its groups
            # are rebuilt, which only a changed fleet fingerprint (the controller's inputs) triggers.  Left out (the
            # same key as _report's cache): the chunk index (VPP: equal local names in two chunks) and the tensors'
            # device.  Safe only because a bridge's chunks are fixed and _shared / _one_host are decided once; a
            # change that reloads chunks or offloads parameters between syncs must add both here.
            rep = None if report is None else {k: v for k, v in report.items() if k not in ("tensors", "group")}
            self._digest = hash((key, repr(rep)))
        return self._digest

    def _tp_groups(self) -> dict:
        """``{member ranks: group}`` of every tensor-parallel group (``GroupMember.NON_GROUP_MEMBER`` where this
        rank is not a member, as ``new_group`` returns there), for the holders' broadcast groups to reuse
        (local_handles.broadcast_group).  Collective over every rank (the control group), once per bridge."""
        if self._tp_known is None:
            group = getattr(self.topo, "tp_group", None)
            mine = tuple(dist.get_process_group_ranks(group)) if group is not None else None
            self._tp_known = {m: (group if m == mine else dist.GroupMember.NON_GROUP_MEMBER)
                              for m in self.topo.all_gather_object(mine) if m}
        return self._tp_known

    def plan(self):
        """Collective: the validated SendPlan (no weights move).  Raises WeightBridgeError on every rank when
        a name or shape does not match the engines.  The next sync plans afresh: this plan's engine-layout state
        (layout_path: DirectPlan, composed writes, mapped arenas) replaced that of the verdict the steady state
        would reuse."""
        try:
            return self._plan(None)[0]["plan"]
        finally:
            self._steady.drop()  # every rank: plan() is a collective

    # ---- sync ---------------------------------------------------------------------------------
    def _buffers(self, plan) -> BufferPool:
        fitting = [b.nbytes for s in plan.stages for b in s.buckets if b.nbytes <= self.bucket_bytes]
        need, count = max(fitting or [1]), 2 if self.overlap else 1
        if self._pool is None or self._pool.max_bytes < need or len(self._pool._buffers) != count:
            if self._pool is not None:
                self._pool.close()
            if self.transport == "tensor":
                prepare_sharing(self.device)
            self._pool = BufferPool(need, count=count, device=self.device, meter=self.meter,
                                    shared=self.transport == "tensor")
        return self._pool

    def sync(self, engines: Sequence[int] | None = None) -> SyncStats:
        """Collective over every trainer rank: push the current weights into the engines (all, or the listed
        indices with the tensor transport; the distributed transport always reaches all).

        Returns SyncStats.  Raises WeightBridgeError on every rank when the plan does not match the engines
        (nothing sent), when an engine call fails (that engine may hold a mix of old and new weights: sync
        again), or when check mode finds a mismatch.
        """
        t0 = time.perf_counter()
        self.meter.reset_peak()
        times = {"produce": 0.0, "receive": 0.0, "deliver": 0.0}
        opening = {} if self.topo.is_controller else None
        self._open_seconds = 0.0
        try:
            verdict, entries, skipped = self._plan(engines, opening)
            plan, targets = verdict["plan"], verdict["targets"]
            if verdict["groups"] is not None:  # every rank (the groups are in the broadcast verdict)
                self.dist.setup(plan, verdict["groups"], verdict["fingerprint"])
        except BaseException:
            self._steady.drop()
            close_early(self.engines, opening)  # opened before a plan (or a group setup) that failed: leave none open
            raise
        token = opening.get("token") if opening is not None else None
        sessions = needs_sessions(verdict)  # zero copy: the engines' commit opens and closes its own session
        opened = verdict["opened"]  # the go code: what the controller began before the exchange
        if opened == GO_NONE or (opened == GO_BEGUN and sessions):  # (planned afresh) begin now; every rank learns
            token, go, waited = (open_sessions(self.engines, targets, sessions=sessions) if self.topo.is_controller
                                 else (None, None, 0.0))
            self._open_seconds += waited
            go = self.topo.broadcast_object(go)
            if isinstance(go, BaseException):
                self._steady.drop()
                raise go
            opened = GO_OPENED if sessions else GO_BEGUN
        if opened == GO_BEGUN:
            times["ended"] = list(targets)  # no session to close, whatever happens next
        direct = verdict["direct"]
        stats = SyncStats(plan_seconds=time.perf_counter() - t0, bytes=plan.total_bytes, num_tensors=plan.num_tensors,
                          num_buckets=len(direct.buckets) if direct else plan.num_buckets,
                          replanned=verdict["replanned"], skipped_buffers=skipped, open_seconds=self._open_seconds)
        stats.path, stats.fallback_reason, stats.fallback_syncs = self.layout_path.account(
            direct, verdict["direct_reason"], self.topo.is_controller)
        samples: dict[str, torch.Tensor] = {}
        names = set(plan.check_names)

        def record(_plan, bplan, buf):
            if names:
                sample_rows(buf, bplan, names, self.check_rows, samples)

        error, reached = None, targets
        try:
            error, reached = self._deliver(plan, entries, targets, verdict["tp_size"], token, record, times, direct,
                                           verdict["serving"])
        except Exception as e:  # noqa: BLE001 - reported below so every rank raises the same error
            error = f"rank {self.topo.rank}: {type(e).__name__}: {e}"
        t_finish = time.perf_counter()
        if self.topo.is_controller:
            try:
                still_open = [i for i in reached if i not in times.get("ended", ())]
                if still_open:
                    self.engines.end_weight_update(engines=still_open)
                self.engines.end_sync(token, [] if error else reached)
            except Exception as e:  # noqa: BLE001
                error = error or f"end_weight_update: {type(e).__name__}: {e}"
        stats.finish_seconds = time.perf_counter() - t_finish
        try:
            # the messages (and check mode's samples) travel only when a rank failed (or check mode wants them)
            failed = names or self.topo.any_rank(error is not None)
            outcome = self.topo.all_gather_object((error, samples if names else None)) if failed else []
        finally:
            # every rank is past the controller's end_weight_update here, so the engines answered every bucket
            # and dropped every handle: the pools (and the blocks torch's IPC limbo held for the engines) go back
            self._free_pool()
        errors = [e for e, _ in outcome if e]
        if errors:
            self._steady.drop()
            raise WeightBridgeError("weight sync failed: " + "; ".join(dict.fromkeys(errors)))
        if names:
            try:
                self._check(plan, outcome, stats)
            except BaseException:
                self._steady.drop()
                raise
        self._steady.confirm()
        self.version += 1
        stats.engines = list(reached)
        stats.peak_extra_bytes = self.meter.peak
        stats.produce_seconds, stats.receive_seconds, stats.deliver_seconds = (times["produce"], times["receive"],
                                                                               times["deliver"])
        stats.seconds = time.perf_counter() - t0
        return stats

    def _shared(self, entries):
        """The single-copy shared buckets of this TP group, or None (collective over the TP group, once; also
        records in ``_one_host`` whether the group is on one host with CPU tensors, which zero copy needs).
        ``entries`` None: this rank could not list its tensors (it takes part; the group is not usable)."""
        if self._shared_state is None:
            tp_group = getattr(self.topo, "tp_group", None)
            self._shared_state = False
            if self.shared_buckets is not False and tp_group is not None:
                sb = SharedBuckets(tp_group, self.topo.tp_size, self.topo.tp_rank, self.topo.tp_src, self.meter,
                                   count=2 if self.overlap else 1)
                self._one_host = sb.usable(entries)
                # with expert parallelism the experts live on other ranks than the TP group: no shared buckets
                self._shared_state = sb if self._one_host and getattr(self.topo, "ep_size", 1) == 1 else False
        return self._shared_state or None

    def _free_pool(self) -> None:
        """GPU memory goes back to the trainer after each sync; blocks shared through CUDA IPC stay in torch's
        limbo (not in the cache ``empty_cache`` frees) until collected, once the engines dropped them."""
        if self.device.type != "cpu" and self._pool is not None:
            self._pool.close()
            self._pool = None
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()

    def _deliver(self, plan, entries, targets, engine_tp, token, record, times, direct=None, serving=None):
        """This rank's part of the delivery; returns (error or None, engines reached).  The bucket pools stay
        until :meth:`sync` frees them after its last collective."""
        topo = self.topo
        if getattr(topo, "expert_peer", False) and direct is not None:  # EP > 1, zero copy: write its experts
            return write_shared(topo, self.engines, self.layout_path, direct, direct.stage(topo.pp_rank), entries, targets, times)
        if getattr(topo, "expert_peer", False):  # EP > 1: TP-gather, convert and EP-gather this rank's experts
            collections.deque(hf_stream(entries, topo, self.spec, self.meter), maxlen=0)
            return None, targets
        count = 2 if self.overlap else 1
        if direct is not None:  # every TP rank writes its elements straight into the engine-rank sections
            if not topo.active:  # a data-parallel replica: nothing to write (the engine-layout path has no holders)
                return None, targets
            return self._deliver_direct(direct, entries, targets, engine_tp, token, record, times)
        my_stage = next(s for s in plan.stages if s.pp_rank == topo.pp_rank) if topo.active else None
        shared = self._shared(entries) if topo.active else None
        # with holders, no producer thread: every rank then issues its TP gathers and the holder broadcasts from one
        # thread in one global order (local_handles.py); bucket k+1 is still produced while the engines load
        # bucket k (two buffers, one bucket in flight)
        holding = any(sv.group is not None for sv in serving.values())
        if shared is not None:  # every TP rank writes its shard into the shared bucket
            pool = NO_POOL
            own = lambda: shared.stream(entries, my_stage.buckets, self.spec, times)  # noqa: E731
        else:  # the stage leader gathers, converts and packs
            pool = self._buffers(plan) if topo.is_leader or holding else NO_POOL
            own = lambda: stage_buckets(entries, my_stage.buckets, topo, self.spec, pool, self.meter,  # noqa: E731
                                        self.overlap and not holding, times)
        peer = lambda: collections.deque(own() if shared is not None else  # noqa: E731
                                         hf_stream(entries, topo, self.spec, self.meter), maxlen=0)
        if self.transport == "distributed":
            if topo.is_leader:
                return self.dist.run(plan, my_stage, own, pool, record, times), targets
            if my_stage is not None:  # TP peers take part in the writes / gathers only
                peer()
            return None, targets
        tt = TensorTransport(topo, self.engines, targets, engine_tp, record, times, token, serving)
        if topo.is_controller:
            return tt.run_controller(plan, own, pool, in_flight=count - 1), tt.targets
        error = None
        for stage in plan.stages:  # every other rank: its part in each stage, in stage order
            sv = serving[stage.pp_rank]
            holds = topo.rank in sv.participants(topo.controller)
            holder = lambda: BucketHolder(topo, sv, engine_tp, pool, count, tt._entry)  # noqa: E731
            if stage is my_stage and topo.is_leader:
                error = tt.run_leader(plan, own, pool)
            elif stage is my_stage and holds:  # a TP peer of the leader that holds engine ranks' entries
                holder().run(stage.buckets, entries, self.spec, topo.tp_size,
                             lambda e: collections.deque(hf_stream([e], topo, self.spec, self.meter), maxlen=0))
            elif stage is my_stage:  # a TP peer: the writes / gathers only
                peer()
            elif holds:  # a rank of another stage or data-parallel replica on an engine rank's device
                holder().run(stage.buckets)
        return error, targets

    def _deliver_direct(self, direct, entries, targets, engine_tp, token, record, times):
        """This rank's part of an engine-layout sync: each stage's TP ranks write its buckets, its leader delivers
        them (the controller to the engines, other leaders through the controller)."""
        topo = self.topo
        stage = direct.stage(topo.pp_rank)
        if direct.arenas is not None:
            return write_shared(topo, self.engines, self.layout_path, direct, stage, entries, targets, times)
        shared = self._shared(entries)
        own = lambda: shared.stream_direct(direct, stage.buckets, self.layout_path.ops, entries,  # noqa: E731
                                           times) if stage is not None else iter(())
        if not topo.is_leader:
            collections.deque(own(), maxlen=0)
            return None, targets
        tt = DirectTransport(direct, topo, self.engines, targets, engine_tp, record, times, token)
        if topo.is_controller:
            return tt.run_controller(direct.send, own, NO_POOL, in_flight=1 if self.overlap else 0), tt.targets
        if stage is not None:  # the same per-bucket protocol as the generic path's stage leaders (no holders)
            return tt.run_leader(direct.send, own, NO_POOL), targets
        return None, targets

    def _check(self, plan, outcome, stats: SyncStats) -> None:
        verdict = None
        if self.topo.is_controller:
            sent = {k: v for _, smp in outcome for k, v in (smp or {}).items()}
            stats.check = verify(self.engines, plan.check_names, sent, self.check_rows)
            if stats.check.mismatched:
                verdict = WeightBridgeError(f"engine weights differ from what was sent: {stats.check.mismatched[:10]}")
        verdict = self.topo.broadcast_object(verdict)
        if verdict is not None:
            raise verdict

    def close(self) -> None:
        """Drop the engines' arena mappings, free the buckets, leave the update groups (every rank, before rank 0
        stops the engines: RolloutWorker.close)."""
        self.layout_path.maps.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._shared_state:
            self._shared_state.close()
        self.dist.close()
