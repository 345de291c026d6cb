"""The engine-layout path's state inside one WeightBridge: which plan a sync uses, and why not when it falls back.

The controller asks the engines for their parameter layout once per engines' fingerprint (a restarted engine
is probed again), builds the DirectPlan (engine_layout.py) and ships it to every rank once; every rank composes
its block writes once per plan and all ranks agree that they cover every engine element before the first sync
that uses it.  Each pipeline stage writes and delivers the buckets of the engine parameters its tensors feed.
Whatever stands in the way (another transport, check mode, no shared buckets, an engine whose loaders do more than
copy, a parameter fed by two stages, a plan the shards do not cover) makes the sync take SGLang's generic loading;
the reason is logged once and counted.  On top, with ``zero_copy``, the engines move their parameters into shared
memory once per layout (shared_params.py) and the ranks write straight into them; when the engines cannot (not on
the CPU, ...) the engine-layout buckets are used (logged once, not counted as a fallback).
"""
from __future__ import annotations

import logging
import time

from rlhf.weight_bridge.engine_layout import (DirectPlan, EngineLayout, LayoutUnavailable, agree, build_direct_plan,
                                              compose_writes, fetch_layout)
from rlhf.weight_bridge.shared_params import ArenaMaps, arena_plan
from rlhf.weight_bridge.validate import WeightBridgeError

__all__ = ["EngineLayoutPath"]

logger = logging.getLogger(__name__)


class EngineLayoutPath:
    """Plans, composed writes and fallback accounting of the engine-layout path (``enabled``: try it at all)."""

    def __init__(self, enabled: bool, zero_copy: bool = True):
        self.enabled, self.zero_copy = enabled, zero_copy
        self._shares: tuple | None = None  # controller: (engines' and layout fingerprints, shares or why none)
        self._arena_cache: tuple | None = None  # controller: (bucket plan key, arena plan or why none)
        self.maps = ArenaMaps()  # every rank: the engines' shared parameters, mapped
        self._layout: tuple | None = None  # controller: (engines' fingerprint, EngineLayout or why there is none)
        self._cache: tuple | None = None  # controller: (inputs, DirectPlan)
        self._sent = None  # controller: key of the DirectPlan last broadcast
        self._refused: dict = {}  # controller: DirectPlan key -> why its writes cannot cover the engine
        self._plan: DirectPlan | None = None  # every rank: the DirectPlan last received
        self._ops: tuple | None = None  # (plan key, this rank's ops), agreed by every rank
        self.fallback_syncs = 0
        self._logged: set = set()
        self.epoch = 0  # controller: bumped when its state changes under a cached plan (the next sync re-plans)
        self.layout_seconds = 0.0  # controller: asking the engines for their layout (their one-time probe) + planning
        self.compose_seconds = 0.0  # this rank: composing its block writes (once per plan)

    @property
    def plan(self) -> DirectPlan | None:
        """The DirectPlan last received (None before the first)."""
        return self._plan

    @property
    def ops(self) -> list:
        """This rank's block writes of the agreed plan (engine_layout.compose_writes)."""
        return self._ops[1]

    def verdict(self, plan, reports, fp, engines, transport: str, check, bucket_bytes: int):
        """Controller: ``(DirectPlan, or its key when every rank holds it, or None; reason when None)``."""
        t0 = time.perf_counter()
        direct, reason = self._choose(plan, reports, fp, engines, transport, check, bucket_bytes)
        self.layout_seconds += time.perf_counter() - t0
        if direct is None:
            return None, reason
        if direct.key == self._sent:
            return direct.key, None
        self._sent = direct.key
        return direct, None

    def _choose(self, plan, reports, fp, engines, transport, check, bucket_bytes):
        if not self.enabled:
            return None, None
        if transport != "tensor":
            return None, "the distributed transport broadcasts HF tensors"
        if check:
            return None, "check mode reads HF tensors back"
        leaders = [r for r in reports if r and "tensors" in r]
        if not all(r.get("shared") or (self.zero_copy and r.get("one_host_cpu")) for r in leaders):
            if all(r.get("one_host_cpu") for r in leaders):
                return None, ("expert parallelism: the engine-layout buckets are written by one TP group, which does "
                              "not hold the other ranks' experts (zero copy, which does not need them, is off)")
            return None, ("every trainer TP rank must write into shared buckets or the engines' shared parameters "
                          "(CPU, one host); the TP gather path converts to HF tensors")
        if self._layout is None or self._layout[0] != fp:
            held = self._layout[1] if self._layout and isinstance(self._layout[1], EngineLayout) else None
            try:
                got = fetch_layout(engines, held.fingerprint if held else None)
                self._layout = (fp, held if isinstance(got, str) else got)
            except LayoutUnavailable as e:
                self._layout = (fp, f"the engines' parameter layout is not available: {e}")
        layout = self._layout[1]
        if isinstance(layout, str):
            return None, layout
        stages = [(s.pp_rank, s.leader, {m.name: m.dtype for m in s.metas}) for s in plan.stages]
        inputs = (layout.fingerprint, repr(stages), bucket_bytes)
        try:
            if self._cache is None or self._cache[0] != inputs:
                self._cache = (inputs, build_direct_plan(layout, stages, bucket_bytes))
        except LayoutUnavailable as e:
            return None, str(e)
        direct = self._cache[1]
        if direct.key in self._refused:
            return None, self._refused[direct.key]
        shared = self._arena_plan(direct, fp, engines) if self.zero_copy else None
        if shared is not None and shared.key not in self._refused:
            return shared, None
        if not all(r.get("shared") for r in leaders):
            return None, ("expert parallelism: the engine-layout buckets are written by one TP group, which does not "
                          "hold the other ranks' experts, and the engines' parameters cannot be shared (zero copy)")
        return direct, None

    def _arena_plan(self, direct: DirectPlan, fp, engines) -> DirectPlan | None:
        """Controller: the zero-copy version of ``direct`` (the engines share their parameters once per layout), or
        None (buckets; the reason is logged once)."""
        if self._shares is None or self._shares[0] != (fp, direct.layout.fingerprint):
            try:
                got = engines.share_parameters()
            except Exception as e:  # noqa: BLE001 - buckets then
                got = f"{type(e).__name__}: {e}"
            self._shares, self._arena_cache = ((fp, direct.layout.fingerprint), got), None
        if self._arena_cache is None or self._arena_cache[0] != direct.key:
            try:
                if isinstance(self._shares[1], str):
                    raise LayoutUnavailable(self._shares[1])
                self._arena_cache = (direct.key, arena_plan(direct, self._shares[1]))
            except LayoutUnavailable as e:
                self._arena_cache = (direct.key, None)
                self._log_once(f"weight sync: engine-layout buckets (zero copy not available: {e})", logging.INFO)
        shared = self._arena_cache[1]
        # the engines' arenas hold the layout they shared for: never write another plan's layout into them
        return shared if shared is not None and shared.layout.fingerprint == self._shares[0][1] else None

    def unshare(self) -> None:
        """Controller: an engine stopped sharing (SGLang moved a parameter): ask again before the next sync."""
        self._shares = None
        self.epoch += 1

    def _log_once(self, msg: str, level: int) -> None:
        if msg not in self._logged:
            self._logged.add(msg)
            logger.log(level, msg)

    def receive(self, verdict: dict, entries, topo, spec) -> None:
        """Every rank: take the verdict's DirectPlan (``verdict["direct"]`` becomes the plan or None), compose this
        rank's writes once per plan and agree that they cover the engine (a collective, once per plan); a plan
        that does not is dropped for the generic path (``verdict["direct_reason"]`` says why)."""
        direct = verdict.get("direct")
        if isinstance(direct, DirectPlan):
            self._plan = direct
        elif isinstance(direct, str) and (self._plan is None or self._plan.key != direct):
            raise WeightBridgeError(f"internal: engine-layout plan {direct} never reached rank {topo.rank}")
        verdict["direct"] = self._plan if direct is not None else None
        if direct is None or (self._ops is not None and self._ops[0] == self._plan.key):
            return
        mine, ops = (None, 0), None
        peer = getattr(topo, "expert_peer", False) and self._plan.arenas is not None
        if topo.active or peer:
            t0 = time.perf_counter()
            try:
                ops, covered = compose_writes(self._plan, entries, spec, topo.tp_rank, topo.tp_size, topo.pp_rank,
                                              zeros=topo.active)
                if self._plan.arenas is not None:
                    self.maps.open(self._plan)
                mine = (None, covered)
            except Exception as e:  # noqa: BLE001 - every rank must learn about it
                mine = (f"rank {topo.rank}: {type(e).__name__}: {e}", 0)
            self.compose_seconds += time.perf_counter() - t0
        reason = agree(self._plan, topo.all_gather_object(mine))
        if reason is None:
            self._ops = (self._plan.key, ops)
            return
        if topo.is_controller:
            self._refused[self._plan.key] = reason
        verdict["direct"], verdict["direct_reason"] = None, reason

    def account(self, direct, reason: str | None, is_controller: bool) -> tuple[str, str | None, int]:
        """``(path, fallback reason, fallback syncs so far)`` of a sync; a new reason is logged once (controller)."""
        if direct is not None:
            return "zero_copy" if direct.arenas is not None else "engine_layout", None, self.fallback_syncs
        if not self.enabled:
            return "generic", None, self.fallback_syncs
        self.fallback_syncs += 1
        if is_controller:
            self._log_once(f"weight sync: SGLang's generic loading is used (engine-layout path not available: "
                           f"{reason})", logging.WARNING)
        return "generic", reason, self.fallback_syncs
