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
inputs predict reuse (the engines' ``begin_weight_update`` runs while the ranks list their tensors): GO_NONE not
started (the sync opens them after planning), GO_OPENED, GO_BEGUN (the sync begun without sessions: the verdict to
reuse writes into the engines' shared parameters, and its one commit call per engine opens and closes a session of
its own), or GO_FAILED -- then every rank raises the controller's message, which follows in one object broadcast;
nothing was written.  The controller's
session helpers live here too: :func:`open_sessions` (also refuses a target engine replaced while its session
opened), :func:`close_sessions`, and :func:`close_early` for a sync that fails after it started opening them.

Digests: each slot is only ever compared with the same rank's earlier value, in the same process.  A rank's own
tensor key uses Python's ``hash`` (names, shapes, dtypes: hashable by construction); the digest that combines it with
the controller's inputs (the fleet fingerprint, which need only compare with ``!=``, e.g. a tuple holding a list) is
:func:`digest`, a blake2b of ``repr``, so an unhashable fingerprint cannot break the exchange.
"""
from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist

from parallel import devices
from rlhf.weight_bridge.validate import WeightBridgeError

__all__ = ["PlanCache", "GO_NONE", "GO_OPENED", "GO_FAILED", "GO_BEGUN", "all_gather_codes", "any_rank", "digest",
           "open_sessions", "close_sessions", "close_early", "needs_sessions"]

#: the controller's ``go`` code: sessions not opened before the exchange, opened, failed to open, or the sync begun
#: without sessions (zero copy)
GO_NONE, GO_OPENED, GO_FAILED, GO_BEGUN = 0, 1, 2, 3


def needs_sessions(verdict: dict | None) -> bool:
    """Whether a sync with ``verdict`` sends inside sessions it opens first: every path but zero copy, whose ranks
    write into the engines' shared parameters and whose commit call opens and closes its own session
    (shared_params.write_shared)."""
    direct = (verdict or {}).get("direct")
    return direct is None or getattr(direct, "arenas", None) is None


def digest(obj) -> int:
    """A signed int64 digest of ``repr(obj)`` (blake2b, 8 bytes): needs no hashable ``obj`` and does not depend on
    PYTHONHASHSEED.  ``repr`` must show what matters (tuples, lists, str, int, torch.dtype do)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=8).digest(), "little", signed=True)


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

    @property
    def verdict(self) -> dict | None:
        """The verdict of the last sync that succeeded everywhere (what a steady sync reuses), or None."""
        return self._verdict

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


def open_sessions(engines, targets: list[int], token=None, pending=None, sessions: bool = True) -> tuple:
    """Controller: ``engines.begin_sync()`` + every target's begin_weight_update (``token`` / ``pending``: already
    started, ``pending`` may be the exception starting them raised; ``sessions=False``: begin_sync only, for zero
    copy); returns ``(token, error or None, seconds waited for the begins)``.  On an error every target's session is
    closed again, except when ``begin_sync`` itself refuses (no session was opened).  A target engine replaced while its session opened (the manager's ``wait`` replaces a dead engine
    and returns None) is an error too: the new engine has no session and, with the distributed transport, never
    joined the group, where the broadcast would wait for it until the group's timeout; and the plan was validated
    against the old engine."""
    waited = 0.0
    if pending is None:
        # Before the try: a refused begin_sync (a generate in progress) opened no session, and closing one would
        # queue end_weight_update behind that generate on the one-call-at-a-time engine actor.
        try:
            token = engines.begin_sync()
        except Exception as e:  # noqa: BLE001
            return token, WeightBridgeError(f"begin_sync refused: {type(e).__name__}: {e}"), waited
    try:
        if pending is None:
            pending = engines.start_weight_update(engines=targets) if sessions else []
        if isinstance(pending, BaseException):
            raise pending
        t0 = time.perf_counter()
        engines.wait(pending, "begin_weight_update")
        waited = time.perf_counter() - t0
        replaced = [i for i in engines.replaced_since(token) if i in targets] if token is not None else []
    except Exception as e:  # noqa: BLE001
        if sessions:
            close_sessions(engines, targets)
        what = "begin_weight_update" if sessions else "begin_sync"
        return token, WeightBridgeError(f"{what} failed: {type(e).__name__}: {e}"), waited
    if replaced:
        if sessions:
            close_sessions(engines, targets)
        return token, WeightBridgeError(f"engine(s) {replaced} replaced while opening the weight-update sessions; "
                                        f"nothing was sent: sync again"), waited
    return token, None, waited


def close_sessions(engines, targets: list[int]) -> None:
    """Controller: close the sessions of a sync that will not write (errors ignored: the sync already fails).

    Also right after a begin_weight_update that failed on one engine (``wait`` raised there and did not collect the
    others): each engine actor runs one call at a time, in the order this caller submitted them (Ray actors with
    ``max_concurrency=1``, rlhf/rollout/placement.py), so every engine runs this end after its begin.  A threaded or
    async engine actor would break that (the end first, the session left open)."""
    try:
        engines.end_weight_update(engines=targets)
    except Exception:  # noqa: BLE001
        pass


def close_early(engines, opening: dict | None) -> None:
    """Controller, a sync that fails after it started opening the sessions before the exchange (``opening`` as
    WeightBridge._plan fills it): wait for the begins (errors ignored), then close the sessions; nothing when none
    was started (zero copy begins without sessions) or :func:`open_sessions` already reported an error (it closed
    them)."""
    if not opening or "pending" not in opening or opening.get("error") is not None or not opening.get("sessions"):
        return
    pending = opening["pending"]
    if not isinstance(pending, BaseException):
        try:
            engines.wait(pending, "begin_weight_update")
        except Exception:  # noqa: BLE001 - the sync already fails; closing is what matters
            pass
    close_sessions(engines, list(opening["inputs"][1]))
