"""SyncStats: the outcome of one WeightBridge.sync on a trainer rank, and the trainer metrics it reports."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.weight_bridge.check import CheckReport

__all__ = ["SyncStats"]


@dataclass
class SyncStats:
    """Outcome of one :meth:`WeightBridge.sync` on this rank (byte counts global, timings local, seconds)."""

    seconds: float = 0.0
    plan_seconds: float = 0.0  # the plan check (or planning) + opening the engines' sessions
    open_seconds: float = 0.0  # controller: of plan_seconds, waiting for the engines' sessions to open
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    peak_extra_bytes: int = 0  # bucket buffers + gathered/converted tensors on this rank
    produce_seconds: float = 0.0  # waiting for this rank's own buckets (TP gather, convert, pack)
    receive_seconds: float = 0.0  # controller: waiting for other stages' leaders and holders
    deliver_seconds: float = 0.0  # engine calls / broadcasts (and waiting for the engines)
    finish_seconds: float = 0.0  # controller: end_weight_update on every engine
    replanned: bool = False  # planned and validated against the engines afresh (first sync, an engine replaced)
    engines: list[int] = field(default_factory=list)  # engines the sync reached
    skipped_buffers: list[str] = field(default_factory=list)
    check: CheckReport | None = None

    def metrics(self) -> dict[str, float]:
        """The sync's trainer metrics: ``weight_sync/bytes`` (bytes sent to each engine), ``weight_sync/buckets``
        and ``weight_sync/replanned`` (1.0 when the sync planned and validated against the engines afresh)."""
        return {"weight_sync/bytes": float(self.bytes), "weight_sync/buckets": float(self.num_buckets),
                "weight_sync/replanned": float(self.replanned)}
