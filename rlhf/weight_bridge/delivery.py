"""The per-bucket protocol of one sync, the same for both transports.  Only the controller talks to the engines.

1. the stage's leader produces the bucket; a leader other than the controller reports None or its first error;
2. the controller decides (the transport's ``start(plan, stage, bplan)``, falsy: no go): nothing after any error,
   else the bucket starts on the engines; the decision goes to the stage's leader and holders (``participants``), so
   nothing is serialized or broadcast that no engine takes (docs/gpu.md D8, an engine's group held until timeout);
3. on a go the data moves: ``move(plan, stage, bplan, buf, go)`` on the controller (``buf`` when it leads the stage),
   ``lead(stage, bplan, buf, go)`` on another leader;
4. the controller waits for the engines (``wait(call)`` on what ``move`` returned; its own stage keeps up to
   ``in_flight`` buckets loading while the next is produced), then acks a leader other than itself, which reuses its
   buffer only after the ack.

Every rank goes through every bucket of its part, also after an error (the TP peers' gathers go on), so no rank
waits for a message that never comes.  A collective that itself fails is not covered.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Iterator

from rlhf import faults


class Delivery:
    """One sync's delivery on this rank; a transport defines ``start``, ``move``, ``lead`` and ``wait`` (module
    docstring).  ``record(bucket, buffer)`` (or None) sees each produced buffer; ``times``: ``receive`` / ``deliver``
    seconds; ``error``: the first one."""

    def __init__(self, topo, engines, record: Callable | None, times: dict):
        self.topo, self.engines, self.record, self.times = topo, engines, record, times
        self.error: str | None = None

    def participants(self, stage) -> list[int]:
        """Controller: the ranks told each decision of ``stage``: its leader when that is another rank."""
        return [stage.leader] if stage.leader != self.topo.rank else []

    def stage_done(self, stage) -> None:
        """Controller: the engines answered the stage's last bucket."""

    def fail(self, e: BaseException | str) -> None:  # keeps the first error
        self.error = self.error or (e if isinstance(e, str) else f"rank {self.topo.rank}: {type(e).__name__}: {e}")

    def run_controller(self, plan, own: Callable[[], Iterator], pool, in_flight: int = 0) -> str | None:
        """Every stage's buckets in order (``own()``: this rank's ``(bucket, slot, buffer)``); the first error."""
        for stage in plan.stages:
            mine = own() if stage.leader == self.topo.rank else None
            pending = collections.deque()
            for bplan in stage.buckets:
                slot = buf = None
                if mine is not None:
                    slot, buf = self._next(mine, bplan)
                else:
                    t0 = time.perf_counter()
                    report = self.topo.recv_object(stage.leader)
                    self.times["receive"] += time.perf_counter() - t0
                    if report:
                        self.fail(report)
                go = call = None
                if self.error is None:
                    try:
                        go = self.start(plan, stage, bplan)
                    except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
                        self.fail(e)
                for rank in self.participants(stage):
                    self.topo.send_object(go, rank)
                if go:
                    try:
                        call = self.move(plan, stage, bplan, buf, go)
                    except Exception as e:  # noqa: BLE001
                        self.fail(e)
                pending.append((call, slot, stage.leader, plan.is_last(stage, bplan)))
                while len(pending) > (in_flight if mine is not None else 0):  # the buffer reused next is loaded
                    self._finish(pool, *pending.popleft())
            while pending:
                self._finish(pool, *pending.popleft())
            if mine is not None:
                self._exhaust(mine)  # always: the TP peers' gathers
            self.stage_done(stage)
        return self.error

    def run_leader(self, plan, stage, own: Callable[[], Iterator], pool) -> str | None:
        """A leader other than the controller: per bucket report, take the decision, move on a go; its first error."""
        ctrl, it = self.topo.controller, own()
        for bplan in stage.buckets:
            slot, buf = self._next(it, bplan)
            t0 = time.perf_counter()
            try:
                self.topo.send_object(self.error, ctrl)
                go = self.topo.recv_object(ctrl)
                if go:  # never after this rank's error: the controller decides nothing then
                    try:
                        self.lead(stage, bplan, buf, go)
                    except Exception as e:  # noqa: BLE001 - reported with the next bucket
                        self.fail(e)
                self.topo.recv_object(ctrl)  # the engines are done with this bucket
            finally:
                self.times["deliver"] += time.perf_counter() - t0
                pool.release(slot)
        self._exhaust(it)
        return self.error

    def _finish(self, pool, call, slot, leader: int, last: bool) -> None:
        t0 = time.perf_counter()
        try:
            if call is not None:
                self.wait(call)
        except Exception as e:  # noqa: BLE001
            self.fail(e)
        finally:
            self.times["deliver"] += time.perf_counter() - t0
            pool.release(slot)
            if leader != self.topo.rank:
                self.topo.send_object(True, leader)
        faults.maybe_fail("sync_weights", last=last)  # fault-injection point: a bucket delivered

    def _next(self, it, bplan) -> tuple:
        """The next ``(slot, buffer)`` of a leader's stream, the buffer None after an error (taken anyway)."""
        slot = None
        try:
            item = next(it, None)
            if item is None:
                raise RuntimeError(f"the stream ended before bucket {bplan.index}")
            got, slot, buf = item
            if isinstance(buf, BaseException):
                raise buf
            if got is not bplan:
                raise RuntimeError(f"bucket {got.index} produced where {bplan.index} was planned")
            if self.record is not None:
                self.record(bplan, buf)
            return slot, buf
        except Exception as e:  # noqa: BLE001 - reported to the controller, then to every rank
            self.fail(e)
            return slot, None

    def _exhaust(self, it) -> None:
        """Run a leader's stream to its end (it raises when it disagrees with the plan)."""
        try:
            collections.deque(it, maxlen=0)
        except Exception as e:  # noqa: BLE001
            self.fail(e)
