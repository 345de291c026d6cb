"""WeightBridge: stream the actor's megatron weights into the rollout engines after each update (docs/gpu.md,
"Weight sync").  :meth:`WeightBridge.sync`, a collective over every trainer rank, the same on CPU and GPU, reads top
to bottom: 1. **open**: plan (plan.py) or reuse the plan, open the engines' sessions; 2. **gather -> convert ->
bucket** on each stage's leader (hf_stream.py, bucketing.py), overlapped with 3. **send** bucket by bucket under the
controller's decision (delivery.py; from_tensor.py / from_distributed.py); 4. **commit**: close the sessions, mark the
reached engines fresh, every rank learns whether any rank failed; check mode reads sent rows back.

Tied embeddings: only ``model.embed_tokens.weight`` is sent.  Unmapped persistent buffers are skipped
(``SyncStats.skipped_buffers``), an unmapped parameter is an error.  Typical use::

    bridge = WeightBridge(actor.chunks, actor.spec, manager if dist.get_rank() == 0 else None, WeightSyncConfig())
    optimizer.step(); stats = bridge.sync()
"""
from __future__ import annotations

import collections
import contextlib
import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from parallel.convert import unwrap_model
from parallel.model_config import HFModelSpec
from rlhf.rollout.engine import EngineFleet
from rlhf.rollout.placement import holder_ranks
from rlhf.rollout.readback import CheckReport, verify
from rlhf.weight_bridge.bucketing import DEFAULT_BUCKET_BYTES, BucketPlan, BufferPool, MemoryMeter, bucket_views
from rlhf.weight_bridge.from_distributed import DistributedDelivery, DistributedGroups
from rlhf.weight_bridge.from_tensor import BucketHolder, StageServing, TensorDelivery, broadcast_group, prepare_sharing
from rlhf.weight_bridge.hf_stream import Production, hf_stream, stage_buckets
from rlhf.weight_bridge.plan import (NameMap, SendPlan, WeightBridgeError, build_send_plan, plan_local_tensors,
                                     sync_entries)
from rlhf.weight_bridge.topology import MegatronTopology

__all__ = ["WeightBridge", "WeightSyncConfig", "SyncStats", "sample_rows"]

_NOT_OPENED, _OPENED, _OPEN_FAILED = 0, 1, 2  # the controller's session code in a sync's first exchange
_CHECK_ROWS = 4  # check mode: rows read back per tensor


@dataclass
class WeightSyncConfig:
    """How a :class:`WeightBridge` syncs (the same on every rank).  transport: ``"tensor"`` (colocated) or
    ``"distributed"`` (a broadcast group).  bucket_bytes: memory of the bucket buffers (two of half of it with
    ``overlap``: produce bucket k+1 while bucket k is delivered; a larger tensor gets a bucket of its own).  check:
    None, ``"sample"`` (first and last layer, every non-layer tensor) or ``"all"``: read the first rows of sent tensors
    back (a mismatch raises WeightBridgeError).  name_map: maps extra megatron names to HF tensors
    (plan.regex_name_map).  group_prefix, master_address (parallel.distributed.resolve_address): the distributed
    transport's groups.  Raises ValueError for an unknown transport or check mode, or bucket_bytes < 1."""

    transport: str = "tensor"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    overlap: bool = True
    check: str | None = None
    name_map: NameMap | None = None
    group_prefix: str = "weight_sync"
    master_address: str | None = None
    lora: Any = None  # parallel.lora.LoRASettings: the base weights once, then the adapters alone (_sync_adapters)
    lora_merged_fallback: bool = False  # adapters asked but merged weights sent (MoE experts): a metric per sync

    def __post_init__(self):
        if self.transport not in ("tensor", "distributed"):
            raise ValueError(f"transport={self.transport!r}: use 'tensor' (colocated) or 'distributed' (broadcast)")
        if self.check not in (None, "sample", "all"):
            raise ValueError(f"check={self.check!r}: use None, 'sample' or 'all'")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} must be >= 1")

    @property
    def buffers(self) -> int:
        return 2 if self.overlap else 1

    @property
    def buffer_bytes(self) -> int:
        """One bucket buffer's bytes (a bucket's bound)."""
        return max(1, int(self.bucket_bytes) // self.buffers)


@dataclass
class SyncStats:
    """Outcome of one sync on this rank (bytes global, timings local, seconds; ``engines``: the controller's)."""

    seconds: float = 0.0
    plan_seconds: float = 0.0  # the plan check (or planning) + opening the engines' sessions
    open_seconds: float = 0.0  # controller: of plan_seconds, waiting for the sessions to open
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    peak_extra_bytes: int = 0  # bucket buffers + gathered/converted tensors on this rank
    produce_seconds: float = 0.0  # waiting for this rank's own buckets (TP gather, convert, pack)
    receive_seconds: float = 0.0  # controller: waiting for other stages' leaders and holders
    deliver_seconds: float = 0.0  # engine calls / broadcasts (and waiting for the engines)
    finish_seconds: float = 0.0  # controller: end_weight_update on every engine
    replanned: bool = False  # planned and validated against the engines afresh
    engines: list[int] = field(default_factory=list)  # engines the sync reached
    skipped_buffers: list[str] = field(default_factory=list)
    check: CheckReport | None = None
    lora_merged_fallback: bool = False  # WeightSyncConfig.lora_merged_fallback

    def metrics(self) -> dict[str, float]:
        """``weight_sync/bytes`` (sent to each engine), ``weight_sync/buckets``, ``weight_sync/replanned``;
        ``weight_sync/lora_merged_fallback`` = 1 with lora_reference.adapter_sync_settings' merged fallback."""
        return {"weight_sync/bytes": float(self.bytes), "weight_sync/buckets": float(self.num_buckets),
                "weight_sync/replanned": float(self.replanned),
                **({"weight_sync/lora_merged_fallback": 1.0} if self.lora_merged_fallback else {})}


@dataclass
class AgreedPlan:
    """What every rank agreed at the last planning; kept until the engines or a rank's tensors change."""

    send: SendPlan
    serving: dict[int, StageServing]  # {pp_rank: who serializes each engine rank's entry of the stage's buckets}
    tensors_key: int  # this rank's listing when planned
    engine_tp: int
    fingerprint: Any = None  # controller: the engines' fingerprint it was validated against


@dataclass
class _Sync:
    """One sync in flight on this rank."""

    entries: list = field(default_factory=list)  # the LocalTensors this rank streams
    tensors_key: int = 0
    error: str | None = None  # this rank could not list its tensors
    plan: AgreedPlan | None = None
    targets: list = field(default_factory=list)  # controller: engines to reach (replaced ones dropped on the way)
    token: Any = None  # controller: the fleet's begin_sync token
    sessions_open: bool = False  # controller
    stats: SyncStats = field(default_factory=SyncStats)  # replanned, open_seconds, skipped_buffers filled on the way
    times: dict = field(default_factory=lambda: {"produce": 0.0, "receive": 0.0, "deliver": 0.0})


class WeightBridge:
    """Construct on EVERY trainer rank with the same arguments except ``engines`` (an
    :class:`rlhf.rollout.engine.EngineFleet`), which only the controller (global rank 0) passes.  ``model_chunks``:
    this rank's GPTModel chunks (wrappers are fine); ``topology``: an override (tests).  Raises ValueError when
    ``engines`` is given on another rank or missing on the controller."""

    def __init__(self, model_chunks, spec: HFModelSpec, engines: EngineFleet | None = None,
                 config: WeightSyncConfig | None = None, *, topology=None):
        self.chunks, self.spec, self.engines = list(model_chunks), spec, engines
        self.cfg = config if config is not None else WeightSyncConfig()
        self.topo = topology if topology is not None else MegatronTopology()
        if self.topo.is_controller != (engines is not None):
            raise ValueError(f"the engines' handle goes to global rank {self.topo.controller} and only there "
                             f"(rank {self.topo.rank} got {'one' if engines is not None else 'none'})")
        self.device = next((p.device for c in self.chunks for p in unwrap_model(c).parameters()), torch.device("cpu"))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.dist = DistributedGroups(self.topo, engines, self.cfg.group_prefix, backend, self.cfg.master_address)
        self.meter = MemoryMeter()
        self._pool: BufferPool | None = None
        self._plan: AgreedPlan | None = None
        self._holder_groups: dict = {}  # member ranks -> broadcast group of a stage's holders
        self._tp_known: dict | None = None  # member ranks -> tensor-parallel group (_tp_groups)
        self.base_sent = False  # LoRA: every engine holds the base weights (set it when they started from them)

    def sync(self, engines: Sequence[int] | None = None) -> SyncStats:
        """Collective: push the current weights into the engines (all, or the listed ones with the tensor
        transport).  Raises WeightBridgeError on every rank when the plan does not match the engines or the sessions
        cannot open (nothing sent), when an engine call or a rank fails (an engine may hold a mix of old and new
        weights: sync again; the next sync plans afresh), or when check mode finds a mismatch.  With ``lora``:
        the (unmerged) base weights when some engine may lack them (the first sync, replaced engines, after an
        error), then the adapters.  A sync of all engines sends the base first to the engines replaced since their
        last sync (the fleet's ``stale_engines``): they serve ``model.path``'s base, and the adapters' sync marks them
        fresh."""
        if self.cfg.lora is None:
            return self._sync(engines)
        full = None
        # any engine's base is unknown until a full sync ends; else only a stale engine may lack it
        base_to = (engines if engines is not None or not self.base_sent
                   else list(self._decided(lambda: self.engines.stale_engines())))
        if base_to is None or base_to:
            had, self.base_sent = self.base_sent, False
            full, self.base_sent = self._sync(base_to), had or base_to is None
        return self._sync_adapters(engines, full or SyncStats())

    def _sync_adapters(self, engines, stats: SyncStats) -> SyncStats:
        """Every rank: the adapters in PEFT's layout (parallel.lora_export) from each stage's leader go to the engines
        in one SGLang ``load_lora_adapter_from_tensors`` each (SGLang loads an adapter whole); ``stats`` count them."""
        from parallel.lora_export import peft_adapter_tensors, peft_config

        t0, topo = time.perf_counter(), self.topo
        topo.init_collective()
        mine = peft_adapter_tensors(self.chunks, self.spec) if topo.active else {}  # collective over TP
        tensors = {k: v for part in topo.all_gather_object(mine if topo.is_leader else {}) for k, v in part.items()}
        stats.bytes += sum(t.nbytes for t in tensors.values())
        stats.num_tensors += len(tensors)

        def load():
            stats.engines, token = self._targets(engines), self.engines.begin_sync()
            self.engines.wait(self.engines.load_lora_adapter(tensors, peft_config(self.cfg.lora), stats.engines),
                              "load_lora_adapter")
            self.engines.end_sync(token, stats.engines)

        self._decided(load, "LoRA adapter sync failed: ")
        stats.seconds += time.perf_counter() - t0
        return stats

    def _sync(self, engines: Sequence[int] | None) -> SyncStats:
        t0 = time.perf_counter()
        self.meter.reset_peak()
        s = self._open(engines)  # 1. plan check (or planning) + the engines' sessions: nothing written before
        plan, stats = s.plan.send, s.stats
        stats.plan_seconds = time.perf_counter() - t0
        stats.bytes, stats.num_tensors, stats.num_buckets = plan.total_bytes, plan.num_tensors, plan.num_buckets
        names = set(plan.check_names)
        samples: dict[str, torch.Tensor] = {}  # check mode: the first rows of the checked tensors, before delivery
        record = functools.partial(sample_rows, names=names, rows=_CHECK_ROWS, out=samples) if names else None
        error = self._send(s, record)  # 2-3. gather -> convert -> bucket -> send
        t_commit = time.perf_counter()
        error = self._commit(s, error)  # 4. close the sessions, mark the reached engines fresh
        stats.finish_seconds = time.perf_counter() - t_commit
        try:  # every rank learns whether any rank failed (messages and samples travel only then, or in check mode)
            failed = names or any(c[0] for c in self.topo.all_gather_codes([int(error is not None)]))
            outcome = self.topo.all_gather_object((error, samples if names else None)) if failed else []
        finally:  # every rank is past end_weight_update: the engines dropped every handle
            self._free_pool()
        try:
            if errors := [e for e, _ in outcome if e]:
                raise WeightBridgeError("weight sync failed: " + "; ".join(dict.fromkeys(errors)))
            if names:  # check mode: the controller reads the sampled rows back
                self._decided(functools.partial(self._check, plan, outcome, stats))
        except WeightBridgeError:
            self._plan = None  # the next sync plans afresh
            raise
        stats.engines, stats.peak_extra_bytes = list(s.targets), self.meter.peak
        stats.produce_seconds, stats.receive_seconds, stats.deliver_seconds = s.times.values()
        stats.seconds = time.perf_counter() - t0
        return stats

    def _list(self) -> _Sync:
        """This rank's tensors (an error in their place is reported through the planning exchange)."""
        s = _Sync(stats=SyncStats(lora_merged_fallback=self.cfg.lora_merged_fallback))
        self.topo.init_collective()
        try:
            s.entries, s.stats.skipped_buffers = sync_entries(self.chunks, self.spec, self.cfg.name_map, self.topo)
            if self.cfg.lora is not None:  # the engines add the adapters themselves: the base weights unmerged
                s.entries = [replace(e, merge=None) for e in s.entries]
            s.tensors_key = hash(tuple((e.chunk_index, e.local_name, tuple(e.tensor.shape), e.tensor.dtype)
                                       for e in s.entries))
        except Exception as e:  # noqa: BLE001
            s.error = f"rank {self.topo.rank}: {type(e).__name__}: {e}"
        return s

    def _open(self, engines) -> _Sync:
        """Every rank: this sync's tensors and plan, the sessions open.  The controller opens them first when the
        engines' fingerprint is the plan's; ONE tensor all_gather of ``[ok, tensors unchanged, session code]`` then
        lets every rank reuse the plan, else it plans afresh.  No session stays open on an error."""
        topo, s = self.topo, self._list()
        code, open_error = _NOT_OPENED, None
        try:
            if topo.is_controller and s.error is None:
                try:
                    s.targets = self._targets(engines)
                    if self._plan is not None and self._plan.fingerprint == self.engines.fingerprint():
                        open_error = self._open_sessions(s)
                        code = _OPENED if s.sessions_open else _OPEN_FAILED
                except Exception as e:  # noqa: BLE001 - reported through the planning exchange
                    s.error = f"rank {topo.rank}: {type(e).__name__}: {e}"
            same = self._plan is not None and self._plan.tensors_key == s.tensors_key
            codes = topo.all_gather_codes([int(s.error is None), int(same), code])
            code = codes[topo.controller][2]
            if code == _OPEN_FAILED:
                raise topo.broadcast_object(open_error if topo.is_controller else None)
            reuse = code == _OPENED and all(c[0] and c[1] for c in codes)
            s.plan = self._plan if reuse else self._replan(s, open_sessions_too=True)
        except BaseException:
            if code != _OPEN_FAILED:  # nothing but the sessions failed: the plan stays valid
                self._plan = None
            if s.sessions_open:
                _close_sessions(self.engines, s.targets)
            raise
        return s

    def _open_sessions(self, s: _Sync) -> WeightBridgeError | None:
        """Controller: ``begin_sync`` (its token tells which engines are replaced meanwhile), then every target's
        ``begin_weight_update`` (SGLang >= 0.5.23 loads weights only in such a session); the error, or None.  An error
        closes the sessions again, except a refused ``begin_sync`` (a generate runs: a close would queue behind it).
        A target replaced while its session opened is an error: it has no session and would join no broadcast."""
        engines, targets = self.engines, s.targets
        try:
            s.token = engines.begin_sync()
        except Exception as e:  # noqa: BLE001
            return WeightBridgeError(f"begin_sync refused: {type(e).__name__}: {e}")
        t0 = time.perf_counter()
        try:
            engines.wait(engines.start_weight_update(engines=targets), "begin_weight_update")
            replaced = [i for i in engines.replaced_since(s.token) if i in targets]
        except Exception as e:  # noqa: BLE001
            _close_sessions(engines, targets)
            return WeightBridgeError(f"begin_weight_update failed: {type(e).__name__}: {e}")
        s.stats.open_seconds = time.perf_counter() - t0
        if replaced:
            _close_sessions(engines, targets)
            return WeightBridgeError(f"engine(s) {replaced} replaced while opening the weight-update sessions; "
                                     f"nothing was sent: sync again")
        s.sessions_open = True
        return None

    def _send(self, s: _Sync, record: Callable) -> str | None:
        """This rank's part of gather -> convert -> bucket -> send (every bucket, also after an error); its error."""
        topo, plan, serving = self.topo, s.plan.send, s.plan.serving
        try:
            stage = {st.pp_rank: st for st in plan.stages}[topo.pp_rank] if topo.active or topo.expert_peer else None
            holding = any(sv.group is not None for sv in serving.values())  # then no producer thread (from_tensor)
            pool = self._buffers(plan) if topo.is_leader or holding else None
            own = functools.partial(stage_buckets, s.entries, stage.buckets if stage else [], topo, self.spec, pool,
                                    self.meter, self.cfg.overlap and not holding, s.times)
            if self.cfg.transport == "distributed":  # the engines answer each bucket before the next is asked
                d, in_flight = DistributedDelivery(topo, self.engines, record, s.times, self.dist, s.token), 0
            else:
                d, in_flight = (TensorDelivery(topo, self.engines, record, s.times, s.targets, s.plan.engine_tp,
                                               s.token, serving, pool), self.cfg.buffers - 1)
            if topo.is_controller:
                error = d.run_controller(plan, own, pool, in_flight)
                s.targets = getattr(d, "targets", s.targets)  # without the engines replaced meanwhile
                return error
            error = None
            for st in plan.stages:  # every other rank: its part in each stage, in stage order
                sv = serving[st.pp_rank]
                holds = self.cfg.transport == "tensor" and topo.rank in sv.participants(topo.controller)
                if st is stage and topo.is_leader:
                    error = d.run_leader(plan, st, own, pool)
                elif st is stage:  # a TP peer of the leader, an expert peer (EP > 1) or its TP peer: its part in
                    state = Production()  # the leader's gathers; holding, each broadcast in between (from_tensor.py)
                    part = functools.partial(_peer_part, topo=topo, spec=self.spec, meter=self.meter, state=state)
                    if holds:
                        BucketHolder(topo, sv, s.plan.engine_tp, pool, self.cfg.buffers).run(
                            st.buckets, s.entries, self.spec, topo.tp_size, topo.ep_size, lambda e: part([e]))
                    else:
                        part(s.entries)
                    if state.error is not None:  # an expert peer's conversion: reported after every collective
                        error = error or f"rank {topo.rank}: {type(state.error).__name__}: {state.error}"
                elif holds:  # a rank of another stage or data-parallel replica on an engine rank's device
                    BucketHolder(topo, sv, s.plan.engine_tp, pool, self.cfg.buffers).run(st.buckets)
            return error
        except Exception as e:  # noqa: BLE001 - reported so every rank raises the same error
            return f"rank {topo.rank}: {type(e).__name__}: {e}"

    def _commit(self, s: _Sync, error: str | None) -> str | None:
        """Controller: close the reached engines' sessions and mark them fresh (none after an error)."""
        if self.topo.is_controller:
            try:
                self.engines.end_weight_update(engines=s.targets)
                self.engines.end_sync(s.token, [] if error else s.targets)
            except Exception as e:  # noqa: BLE001
                error = error or f"end_weight_update: {type(e).__name__}: {e}"
        return error

    # ---- planning ------------------------------------------------------------------------------------
    def _replan(self, s: _Sync, open_sessions_too: bool) -> AgreedPlan:
        """Every rank: the leaders report their HF tensors (any rank its error); the controller validates them, lays
        out buckets and holders, opens the sessions (``open_sessions_too``) and broadcasts the verdict; then the
        groups are set up.  Raises WeightBridgeError on every rank, with nothing sent."""
        topo = self.topo
        self._plan = None
        try:
            report = {"error": s.error} if s.error else self._report(s.entries)
        except Exception as e:  # noqa: BLE001 - reported through the exchange so no rank hangs
            report = {"error": f"rank {topo.rank}: {type(e).__name__}: {e}"}
        reports = topo.all_gather_object(report)
        plan, groups, fingerprint, engine_tp, holders = self._decided(
            lambda: self._verdict(reports, s if open_sessions_too else None))
        if groups is not None:
            self.dist.setup(plan, groups, fingerprint)
        s.stats.replanned = True
        self._plan = AgreedPlan(plan, self._serving(plan, holders), s.tensors_key, engine_tp,
                                fingerprint if topo.is_controller else None)
        return self._plan

    def _report(self, entries) -> dict | None:
        """A stage leader's report: the HF tensors its entries convert to (and its group's rendezvous)."""
        topo = self.topo
        if not topo.is_leader:
            return None
        group = self.dist.report() if self.cfg.transport == "distributed" else None
        return {"pp_rank": topo.pp_rank, "rank": topo.rank, "group": group,
                "tensors": plan_local_tensors(entries, self.spec, topo.tp_size, topo.ep_size)}

    def _verdict(self, reports: list, s: _Sync | None) -> tuple:
        """Controller: the reports validated (a rank's error raised) -> ``(plan, groups' rendezvous (if new), engines'
        fingerprint, engine TP size, each stage's holders (colocated))``; then ``s``'s sessions opened (not None)."""
        if errors := [r["error"] for r in reports if r is not None and "error" in r]:
            raise WeightBridgeError("weight sync refused before sending anything: " + "; ".join(errors))
        cfg, fp = self.cfg, self.engines.fingerprint()
        plan = build_send_plan(reports, self.topo.controller, self.engines.expected_weights(), self.spec,
                               bucket_bytes=cfg.buffer_bytes, check=cfg.check)
        new_groups = cfg.transport == "distributed" and self.dist.fingerprint != fp
        groups = {r["pp_rank"]: r["group"] for r in reports if r} if new_groups else None
        holders = {}
        if cfg.transport == "tensor":
            for stage in plan.stages:
                held = holder_ranks(self.engines.num_engines, self.engines.tp_size, self.topo.world, stage.leader)
                if any(r != stage.leader for r in held.values()):
                    holders[stage.pp_rank] = held
        if s is not None and not s.sessions_open and (err := self._open_sessions(s)) is not None:
            raise err
        return plan, groups, fp, self.engines.tp_size, holders

    def _decided(self, decide: Callable[[], Any], what: str = "") -> Any:
        """Collective (one object broadcast): the controller's ``decide()`` on every rank; when it raised, every rank
        raises it as a WeightBridgeError (another error wrapped, after ``what``)."""
        self.topo.init_collective()
        out = None
        if self.topo.is_controller:
            try:
                out = decide()
            except Exception as e:  # noqa: BLE001 - every rank must learn about it
                out = e if isinstance(e, WeightBridgeError) else WeightBridgeError(f"{what}{type(e).__name__}: {e}")
        if isinstance(out := self.topo.broadcast_object(out), BaseException):
            raise out
        return out

    def _serving(self, plan: SendPlan, holders: dict) -> dict[int, StageServing]:
        """Every rank: ``{pp_rank: StageServing}`` (collective once per new member set, in stage order)."""
        serving = {}
        for stage in plan.stages:
            held, group = holders.get(stage.pp_rank), None
            if held is not None:
                members = tuple(sorted({stage.leader, *held.values()}))
                if members not in self._holder_groups:
                    self._holder_groups[members] = broadcast_group(members, self.topo.world, self._tp_groups())
                group = self._holder_groups[members]
            serving[stage.pp_rank] = StageServing(stage.leader, held, group)
        return serving

    def _targets(self, engines) -> list[int]:
        everyone = list(range(self.engines.num_engines))
        return everyone if engines is None or self.cfg.transport == "distributed" else sorted(set(engines))

    def _tp_groups(self) -> dict:
        """``{member ranks: group}`` of every TP group (``NON_GROUP_MEMBER`` where this rank is not in it, as
        ``new_group`` returns there), for the holders' groups to reuse.  Collective, once per bridge."""
        if self._tp_known is None:
            mine = tuple(self.topo.tp_ranks)
            self._tp_known = {m: (self.topo.tp_group if m == mine else dist.GroupMember.NON_GROUP_MEMBER)
                              for m in self.topo.all_gather_object(mine)}
        return self._tp_known

    def plan(self) -> SendPlan:
        """Collective: plan and validate against the engines, nothing sent, no session opened (the next sync reuses
        it).  Raises WeightBridgeError on every rank when a name or shape does not match the engines."""
        return self._replan(self._list(), open_sessions_too=False).send

    # ---- buffers, check mode, close ------------------------------------------------------------------
    def _buffers(self, plan: SendPlan) -> BufferPool:
        need = max([b.nbytes for st in plan.stages for b in st.buckets if b.nbytes <= self.cfg.buffer_bytes] or [1])
        if self._pool is None or self._pool.max_bytes < need:
            if self._pool is not None:
                self._pool.close()
            if self.cfg.transport == "tensor":
                prepare_sharing(self.device)
            self._pool = BufferPool(need, count=self.cfg.buffers, device=self.device, meter=self.meter,
                                    shared=self.cfg.transport == "tensor")
        return self._pool

    def _free_pool(self) -> None:
        """Device buffers go back after each sync (CPU ones are kept: the engines keep their mappings, keep_mapped)."""
        if self.device.type != "cpu" and self._pool is not None:
            self._pool.close()
            self._pool = None
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()  # blocks shared through CUDA IPC wait in torch's limbo until collected

    def _check(self, plan: SendPlan, outcome: list, stats: SyncStats) -> None:
        """Controller: ``plan.check_names`` read back against the ranks' samples; WeightBridgeError on a mismatch."""
        sent = {k: v for _, smp in outcome for k, v in (smp or {}).items()}
        stats.check = verify(self.engines, plan.check_names, sent, _CHECK_ROWS)
        if stats.check.mismatched:
            raise WeightBridgeError(f"engine weights differ from what was sent: {stats.check.mismatched[:10]}")

    def close(self) -> None:
        """Every rank, before rank 0 stops the engines: free the buckets, leave the groups; a later sync replans."""
        self._plan = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self.dist.close()


def _peer_part(entries, topo, spec, meter, state: Production) -> None:
    """This rank's part in its stage leader's gathers of ``entries`` (hf_stream; a conversion error stays in
    ``state``: the rank goes on with its later collectives)."""
    collections.deque(hf_stream(entries, topo, spec, meter, state), maxlen=0)


def _close_sessions(engines, targets: list[int]) -> None:
    """Close the sessions of a sync that will not write (errors ignored: it already fails).  Safe after a failed
    begin: each engine actor runs its calls one at a time in submission order, so this end runs after its begin."""
    with contextlib.suppress(Exception):
        engines.end_weight_update(engines=targets)


def sample_rows(bplan: BucketPlan, buf: torch.Tensor, names: set, rows: int, out: dict) -> None:
    """Copy the first ``rows`` rows (fp32, CPU) of every tensor of bucket ``bplan`` named in ``names`` into ``out``."""
    for name, view in bucket_views(buf, bplan):
        if name in names:
            part = view.reshape(view.shape[0], -1)[:rows] if view.dim() > 1 else view[:rows]
            out[name] = part.detach().to("cpu", torch.float32).clone()
