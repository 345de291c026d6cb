"""Colocated transport: ``update_weights_from_tensor`` with SGLang's ``FlattenedTensorBucket``.

Each engine TP rank's entry of a bucket is serialized by the process that owns the memory it maps: the trainer
rank on that engine rank's device, which holds a copy of the bucket (local_handles.py), or the stage leader that
filled it: ``{"flattened_tensor": bucket, "metadata": [FlattenedTensorMetadata]}`` through torch's multiprocessing
pickler, i.e. a CUDA IPC handle on GPU and a shared-memory file name on CPU (buffers live in /dev/shm under the
``file_system`` sharing strategy).  Only those bytes cross the control group and Ray; the engine's TP ranks map
the trainer's memory and load from it, so no tensor received through IPC is ever re-shared.  Only the controller
talks to the engines; it decides per bucket which engines get it before anyone serializes (the protocol is in
local_handles.py), and a stage leader reuses its buffer after the controller's ack.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rlhf import faults

from rlhf.weight_bridge.bucketing import BucketPlan, BufferPool
from rlhf.weight_bridge.local_handles import Copies, StageServing
from rlhf.weight_bridge.plan import SendPlan

__all__ = ["serialize_bucket", "prepare_sharing", "TensorTransport"]

_PATCHED = False


def prepare_sharing(device: torch.device) -> None:
    """Make buffers of ``device`` shareable by handle: the ``file_system`` strategy on CPU (a file name
    any process can map, needed because the engine's schedulers are not our children), SGLang's CUDA
    reductions (device UUIDs instead of indices) on GPU."""
    global _PATCHED
    if device.type == "cpu":
        torch.multiprocessing.set_sharing_strategy("file_system")
    elif not _PATCHED:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        _PATCHED = True


def serialize_bucket(buf: torch.Tensor, bplan: BucketPlan, copies: int) -> list[bytes]:
    """``copies`` serialized FlattenedTensorBucket payloads of the flat uint8 ``buf`` laid out as ``bplan``
    (one per receiving engine TP rank: each rank deserializes its own, so IPC references drop cleanly).
    The bytes reference ``buf``'s memory; they do not copy it."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    metadata = [FlattenedTensorMetadata(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype, start_idx=off,
                                        end_idx=off + m.nbytes, numel=m.nbytes)
                for m, off in zip(bplan.metas, bplan.offsets)]
    obj = {"flattened_tensor": buf, "metadata": metadata}
    return [MultiprocessingSerializer.serialize(obj) for _ in range(copies)]


class TensorTransport:
    """One sync's colocated delivery: the controller's side (:meth:`run_controller`) and a stage leader's other
    than the controller (:meth:`run_leader`); the other holders' side is local_handles.BucketHolder.

    Per bucket (local_handles.py, "the per-bucket protocol"): a leader other than the controller reports whether
    it produced the bucket; the controller decides which engines get it (:meth:`_decide`: none after an error,
    none replaced since the sync began) and tells that stage's leader and holders, so that only entries the
    controller hands to an engine are serialized; the holders' entries (``serving``) come back to the controller,
    which calls the engines; a leader other than the controller reuses its buffer after the controller's ack.

    Args:
        topo: the topology; engines: the engines' handle (controller only, else None);
        targets: engine indices receiving this sync (every rank knows them); tp_size: engine TP size;
        token: the controller's ``engines.begin_sync()`` token (engines replaced since are dropped);
        record: ``record(plan, bucket, buf)`` called on the buffer's owner before delivery (check mode);
        times: timing accumulator (``deliver``, ``receive``);
        serving: ``{pp_rank: local_handles.StageServing}``; None: every stage's leader serializes every entry.
    """

    def __init__(self, topo, engines, targets: list[int], tp_size: int, record: Callable, times: dict,
                 token=None, serving: dict | None = None):
        self.topo, self.engines, self.tp_size, self.token = topo, engines, tp_size, token
        self.targets = list(targets)
        self.record, self.times, self.serving = record, times, serving
        self.error: str | None = None

    def _serving(self, stage) -> StageServing:
        if self.serving is None or stage.pp_rank not in self.serving:
            return StageServing(stage.leader)
        return self.serving[stage.pp_rank]

    def _fail(self, e: BaseException | str) -> None:
        self.error = self.error or (e if isinstance(e, str) else f"{type(e).__name__}: {e}")

    def _decide(self) -> list[int]:
        """Controller: the engines that get the next bucket: none after an error, else the targets not replaced
        since the sync began (:meth:`_wait` drops those)."""
        return [] if self.error is not None else list(self.targets)

    def _entry(self, buf: torch.Tensor, bplan: BucketPlan, engine: int, tp_rank: int) -> bytes:
        """Engine ``engine``'s TP-rank-``tp_rank`` entry of bucket ``bplan`` held in ``buf`` (serialized by the
        process that owns ``buf``)."""
        return serialize_bucket(buf, bplan, 1)[0]

    def _collect(self, plan: SendPlan, stage, bplan: BucketPlan, buf: torch.Tensor | None,
                 engines: list[int], copies: Copies | None = None) -> dict:
        """Controller: tell the stage's leader and holders ``engines``; with any, the leader's broadcast (the
        controller's ``buf`` when it leads the stage, else into one of its ``copies`` when it holds entries) and
        every entry ``{(engine, engine TP rank): bytes}``."""
        sv, me = self._serving(stage), self.topo.rank
        others = sv.participants(me)
        for h in others:
            self.topo.send_object(engines, h)
        if not engines:
            return {}
        if sv.group is not None:
            if buf is None:
                buf = copies.take(bplan.nbytes)
            dist.broadcast(buf, src=sv.leader, group=sv.group)
        got = {m: self._entry(buf, bplan, *m) for m in sv.mine(me, engines, self.tp_size)}
        t0 = time.perf_counter()
        for h in others:
            got.update(self.topo.recv_object(h))
        self.times["receive"] += time.perf_counter() - t0
        return got

    def _send(self, plan: SendPlan, stage, bplan: BucketPlan, payloads: dict, engines: list[int]):
        """Start loading bucket ``bplan`` of ``stage`` on ``engines`` (``payloads[(engine, TP rank)]``); returns
        what :meth:`_wait` takes."""
        rows = [[payloads[(e, r)] for r in range(self.tp_size)] for e in engines]
        return self.engines.update_weights_from_tensor(rows, engines=list(engines), load_format="flattened_bucket",
                                                       flush_cache=plan.is_last(stage, bplan))

    def _wait(self, pending) -> None:
        t0 = time.perf_counter()
        try:
            self.engines.wait(pending, "update_weights_from_tensor")
        finally:
            # an engine replaced meanwhile has no session open: it stays stale until the next sync
            gone = set(self.engines.replaced_since(self.token))
            self.targets = [i for i in self.targets if i not in gone]
            self.times["deliver"] += time.perf_counter() - t0

    def run_controller(self, plan: SendPlan, own: Callable[[], Iterator], pool: BufferPool,
                       in_flight: int = 0) -> str | None:
        """Deliver every stage's buckets in order; returns the first error (after going through every bucket
        with every sender, so that no rank waits for a message).

        ``in_flight``: how many of the controller's own buckets may still be loading while the next one is
        produced (1 with two buffers: bucket k+1 is written while the engines load bucket k)."""
        for stage in plan.stages:
            if stage.leader == self.topo.rank:
                self._own_stage(plan, stage, own, pool, in_flight)
            else:
                self._other_stage(plan, stage, pool)
        return self.error

    def _stage_answered(self, stage) -> None:
        """Controller: the engines answered the stage's last bucket; its holders other than the leader may give
        their copies back to their pools (local_handles.py, step 5)."""
        sv = self._serving(stage)
        for h in sv.participants(self.topo.rank):
            if h != sv.leader:
                self.topo.send_object(True, h)

    def _other_stage(self, plan, stage, pool: BufferPool) -> None:
        copies = Copies(pool, 1)  # the controller's copy of a bucket it holds entries of; reused once delivered
        try:
            for bplan in stage.buckets:
                last = plan.is_last(stage, bplan)
                t0 = time.perf_counter()
                kind, body = self.topo.recv_object(stage.leader)
                self.times["receive"] += time.perf_counter() - t0
                if kind == "error":
                    self._fail(body)
                try:
                    engines = self._decide()
                    payloads = self._collect(plan, stage, bplan, None, engines, copies)
                    if engines:
                        self._wait(self._send(plan, stage, bplan, payloads, engines))
                except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
                    self._fail(e)
                finally:
                    self.topo.send_object(True, stage.leader)  # the engines are done with this bucket
                faults.maybe_fail("sync_weights", last=last)
            self._stage_answered(stage)
        finally:
            copies.release_all()

    def _own_stage(self, plan, stage, own, pool, in_flight: int) -> None:
        pending = []  # [(pending call or None, pool slot, last)]

        def finish(item):
            call, slot, last = item
            try:
                if call is not None:
                    self._wait(call)
            except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
                self._fail(e)
            finally:
                pool.release(slot)
            faults.maybe_fail("sync_weights", last=last)  # fault-injection point: a bucket delivered

        it = own()
        for bplan in stage.buckets:
            last, slot, buf, call = plan.is_last(stage, bplan), None, None, None
            try:
                got, slot, buf = next(it)  # also after a production error: the leader's part in the TP gathers
                if isinstance(buf, BaseException):
                    raise buf
                if got is not bplan:
                    raise RuntimeError(f"bucket {got.index} produced where {bplan.index} was planned")
                self.record(plan, bplan, buf)
            except Exception as e:  # noqa: BLE001 - the other senders still go through every bucket
                self._fail(e)
                buf = None
            try:
                engines = self._decide() if buf is not None else []
                payloads = self._collect(plan, stage, bplan, buf, engines)
                if engines:
                    call = self._send(plan, stage, bplan, payloads, engines)
            except Exception as e:  # noqa: BLE001
                self._fail(e)
            pending.append((call, slot, last))
            while len(pending) > in_flight:  # the buffer the next bucket reuses must be loaded by then
                finish(pending.pop(0))
        while pending:
            finish(pending.pop(0))
        self._stage_answered(stage)

    def run_leader(self, plan: SendPlan, own: Callable[[], Iterator], pool: BufferPool) -> str | None:
        """A stage leader other than the controller: per bucket, report it, take the controller's decision,
        broadcast it to the stage's holders and send the entries this rank holds, reuse the buffer after the ack.
        Returns the production error (after the last bucket's messages: the other ranks go on with theirs)."""
        stage = next(s for s in plan.stages if s.leader == self.topo.rank)
        sv, me, ctrl = self._serving(stage), self.topo.rank, self.topo.controller
        it, error = own(), None
        for bplan in stage.buckets:
            slot = buf = None
            try:  # every bucket, also after an error: the production takes part in the TP peers' gathers
                got, slot, buf = next(it)
                if isinstance(buf, BaseException):
                    raise buf
                if got is not bplan:
                    raise RuntimeError(f"bucket {got.index} produced where {bplan.index} was planned")
                self.record(plan, bplan, buf)
            except Exception as e:  # noqa: BLE001 - the controller reports it
                error = error or f"rank {me}: {type(e).__name__}: {e}"
            t0 = time.perf_counter()
            try:
                self.topo.send_object(("error", error) if error else ("ok", None), ctrl)
                engines = self.topo.recv_object(ctrl)
                if engines:  # never after an error: the controller decides none then
                    if sv.group is not None:
                        dist.broadcast(buf, src=me, group=sv.group)
                    self.topo.send_object({m: self._entry(buf, bplan, *m) for m in sv.mine(me, engines,
                                                                                         self.tp_size)}, ctrl)
                self.topo.recv_object(ctrl)  # the engines are done with this bucket
            finally:
                self.times["deliver"] += time.perf_counter() - t0
                pool.release(slot)
        return error

