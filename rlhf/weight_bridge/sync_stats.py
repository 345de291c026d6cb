"""SyncStats: the outcome of one WeightBridge.sync on a trainer rank, and the trainer metrics it reports."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.weight_bridge.check import CheckReport

__all__ = ["SyncStats"]


@dataclass
class SyncStats:
    """Outcome of one :meth:`WeightBridge.sync` on this rank (byte counts global, timings local, seconds)."""

    seconds: float = 0.0
    plan_seconds: float = 0.0  # plan check (or planning) + opening the engines' sessions
    open_seconds: float = 0.0  # controller: of plan_seconds, waiting for the engines' sessions to open
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    peak_extra_bytes: int = 0  # bucket buffers + gathered/converted tensors on this rank
    produce_seconds: float = 0.0  # waiting for this rank's own buckets (TP gather, convert, pack)
    receive_seconds: float = 0.0  # controller, colocated PP: waiting for other stages' payloads
    deliver_seconds: float = 0.0  # engine calls / broadcasts (and waiting for the engines)
    finish_seconds: float = 0.0  # controller: end_weight_update on every engine
    replanned: bool = False
    path: str = "generic"  # "zero_copy": written into the engines' shared parameters; "engine_layout": buckets in
    # the engines' parameter layout; "generic": SGLang's loaders
    fallback_reason: str | None = None  # why the engine-layout path was not taken (engine_layout on)
    fallback_syncs: int = 0  # syncs of this bridge so far that fell back to the generic path
    engines: list[int] = field(default_factory=list)  # engines the sync reached
    skipped_buffers: list[str] = field(default_factory=list)
    check: CheckReport | None = None

    def metrics(self) -> dict[str, float]:
        """The sync's trainer metrics: ``weight_sync/engine_layout`` (1.0 when the engine-layout path ran, buckets or
        zero copy), ``weight_sync/zero_copy`` (1.0 for zero copy) and ``weight_sync/fallback_syncs`` (syncs of the
        bridge so far on the generic path)."""
        return {"weight_sync/engine_layout": float(self.path in ("engine_layout", "zero_copy")),
                "weight_sync/zero_copy": float(self.path == "zero_copy"),
                "weight_sync/fallback_syncs": float(self.fallback_syncs)}
