"""The steady state of a weight sync: reuse the last verdict after ONE small tensor collective.

A sync is planned against what every rank holds (its tensors' names, shapes and dtypes, its shared-bucket
flags) and against the engines (the fleet fingerprint: restarts, model, TP; the targets; the controller's own
engine-layout state).  Planning exchanges pickled objects (reports, the verdict with the SendPlan, the go of the
engines' sessions, the outcome): gloo object collectives pickle and first exchange sizes, ~2-5 ms each on a
loaded 2-core host.  When nothing changed since the last sync that succeeded on every rank, every rank reuses that
sync's verdict: each rank contributes ``[digest of its own inputs, ok, go]`` to one int64 all_gather on the control
group, and every rank takes the same decision from the same gathered codes -- reuse iff every digest equals the one
it contributed to that last successful sync and every rank is ok.  Anything else (a rank's tensors changed, an
engine restarted, another target list, a rank that could not even list its tensors, a failed last sync) takes the
full planning path, which validates everything again and refuses a mismatch before anything is written.

``go`` is the controller's result of opening the engines' sessions, started before the collective when its own
inputs predict reuse (the engines' ``begin_weight_update``, with the pause of generation, runs while the ranks list
their tensors): GO_NONE not started (the sync opens them after planning), GO_OPENED, or GO_FAILED -- then every rank
raises the controller's message, which follows in one object broadcast; nothing was written.

Digests use Python's ``hash`` within one process: each slot is only ever compared with the same rank's earlier value.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import devices

__all__ = ["PlanCache", "GO_NONE", "GO_OPENED", "GO_FAILED", "all_gather_codes", "any_rank"]

#: the controller's ``go`` code: sessions not opened before the exchange, opened, or failed to open
GO_NONE, GO_OPENED, GO_FAILED = 0, 1, 2


def all_gather_codes(codes: list[int], group, world: int) -> list[list[int]]:
    """Every rank's ``codes`` (int64, the same length on every rank), in rank order: one tensor all_gather on
    ``group`` (on the group's device), no pickling."""
    t = devices.to_group_device(torch.tensor(codes, dtype=torch.int64), group)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return [x.tolist() for x in out]


def any_rank(flag: bool, group) -> bool:
    """True on every rank of ``group`` when ``flag`` is set on any of them (one int32 MAX all_reduce on the group's
    device); doubles as the group's barrier."""
    t = devices.to_group_device(torch.tensor([int(bool(flag))], dtype=torch.int32), group)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


class PlanCache:
    """One rank's view of the last successful sync: the gathered digests and the verdict it ran with."""

    def __init__(self):
        self._agreed: tuple | None = None  # every rank's digest of the last sync that succeeded everywhere
        self._verdict: dict | None = None
        self._pending: tuple | None = None  # digests of the sync in flight that planned afresh, with its verdict

    def predicts_reuse(self, rank: int, digest: int) -> bool:
        """This rank's own inputs are those of the last successful sync (the others' are known only after the
        exchange): the controller then opens the engines' sessions before it."""
        return self._agreed is not None and self._agreed[rank] == digest

    def decide(self, codes: list[list[int]]) -> dict | None:
        """Every rank, on the gathered ``[digest, ok, go]`` codes: the verdict to reuse (a copy: nothing
        re-planned, no groups to set up), or None (plan afresh).  Records the digests for :meth:`confirm`."""
        digests = tuple(c[0] for c in codes)
        if self._agreed == digests and all(c[1] for c in codes):
            self._pending = None
            return dict(self._verdict, replanned=False, groups=None)
        self._pending = (digests, None)
        return None

    def planned(self, verdict: dict) -> None:
        """The verdict this sync planned afresh (after every rank took it in)."""
        if self._pending is not None:
            self._pending = (self._pending[0], verdict)

    def confirm(self) -> None:
        """The sync succeeded on every rank: a fresh plan becomes the one to reuse."""
        if self._pending is not None and self._pending[1] is not None:
            self._agreed, self._verdict = self._pending
        self._pending = None

    def drop(self) -> None:
        """The sync failed (every rank raises): the next one plans afresh."""
        self._agreed = self._verdict = self._pending = None
