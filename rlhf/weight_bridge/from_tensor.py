"""Colocated transport: ``update_weights_from_tensor`` with SGLang's ``FlattenedTensorBucket``.

Each bucket is serialized by the process that owns its memory (the stage leader that filled it), once
per engine TP rank: ``{"flattened_tensor": bucket, "metadata": [FlattenedTensorMetadata]}`` through
torch's multiprocessing pickler, i.e. a CUDA IPC handle on GPU and a shared-memory file name on CPU
(buffers live in /dev/shm under the ``file_system`` sharing strategy).  Only those bytes cross the
control group and Ray; the engine's TP ranks map the trainer's memory and load from it, so no tensor
received through IPC is ever re-shared.  Stages other than the controller's send their payload bytes
to the controller, which talks to the engines, and wait for its ack before reusing the buffer.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from rlhf import faults

from rlhf.weight_bridge.bucketing import BucketPlan, BufferPool
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
    """One sync's colocated delivery on one rank.

    Args:
        topo: the topology; engines: the engines' handle (controller only, else None);
        targets: engine indices receiving this sync (every rank knows them); tp_size: engine TP size;
        token: the controller's ``engines.begin_sync()`` token (engines replaced since are dropped);
        record: ``record(plan, bucket, buf)`` called on the buffer's owner before delivery (check mode);
        times: timing accumulator (``deliver``, ``receive``).
    """

    payloads_always = False  # _payloads is a collective: call it for every bucket, also after an error

    def __init__(self, topo, engines, targets: list[int], tp_size: int, record: Callable, times: dict,
                 token=None):
        self.topo, self.engines, self.tp_size, self.token = topo, engines, tp_size, token
        self.targets, self.initial = list(targets), list(targets)
        self.record, self.times = record, times

    def _payloads(self, plan: SendPlan, bplan: BucketPlan, buf: torch.Tensor) -> list[list[bytes]]:
        return [serialize_bucket(buf, bplan, self.tp_size) for _ in self.initial]

    def _send(self, payloads: list[list[bytes]], last: bool):
        """Start loading one bucket on every target engine; returns what :meth:`_wait` takes."""
        by_engine = dict(zip(self.initial, payloads))
        return self.engines.update_weights_from_tensor([by_engine[i] for i in self.targets], engines=self.targets,
                                                       load_format="flattened_bucket", flush_cache=last)

    def _wait(self, pending) -> None:
        t0 = time.perf_counter()
        try:
            self.engines.wait(pending, "update_weights_from_tensor")
            # an engine replaced meanwhile has no session open: it stays stale until the next sync
            gone = set(self.engines.replaced_since(self.token))
            self.targets = [i for i in self.targets if i not in gone]
        finally:
            self.times["deliver"] += time.perf_counter() - t0

    def _deliver(self, payloads: list[list[bytes]], last: bool) -> None:
        self._wait(self._send(payloads, last))

    def run_controller(self, plan: SendPlan, own: Callable[[], Iterator], pool: BufferPool,
                       in_flight: int = 0) -> str | None:
        """Deliver every stage's buckets in order; returns the first error (after draining every sender).

        ``in_flight``: how many of the controller's own buckets may still be loading while the next one is
        produced (1 with two buffers: bucket k+1 is written while the engines load bucket k)."""
        error = None
        for stage in plan.stages:
            if stage.leader == self.topo.rank:
                error = self._own_stage(plan, stage, own, pool, in_flight) or error
                continue
            for bplan in stage.buckets:
                t0 = time.perf_counter()
                kind, body = self.topo.recv_object(stage.leader)
                self.times["receive"] += time.perf_counter() - t0
                ok = True
                try:
                    if kind == "error":
                        raise RuntimeError(body)
                    if error is None:
                        self._deliver(body, plan.is_last(stage, bplan))
                except Exception as e:  # noqa: BLE001
                    error, ok = error or f"{type(e).__name__}: {e}", False
                finally:
                    self.topo.send_object(ok, stage.leader)  # the leader may reuse its buffer
                faults.maybe_fail("sync_weights", last=plan.is_last(stage, bplan))
        return error

    def _own_stage(self, plan, stage, own, pool, in_flight: int) -> str | None:
        error, pending = None, []  # [(pending call or None, pool slot)]

        def finish(item):
            nonlocal error
            call, slot, last = item
            try:
                if call is not None:
                    self._wait(call)
            except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
                error = error or f"{type(e).__name__}: {e}"
            finally:
                pool.release(slot)
            faults.maybe_fail("sync_weights", last=last)  # fault-injection point: a bucket delivered

        for bplan, slot, buf in own():
            call = None
            try:
                # a handle never loaded would keep CUDA IPC's reference count up: none after an error, unless the
                # payloads are a collective (local_handles: the holders wait for every bucket)
                payloads = self._payloads(plan, bplan, buf) if error is None or self.payloads_always else None
                self.record(plan, bplan, buf)
                if error is None:
                    call = self._send(payloads, plan.is_last(stage, bplan))
            except Exception as e:  # noqa: BLE001
                error = error or f"{type(e).__name__}: {e}"
            pending.append((call, slot, plan.is_last(stage, bplan)))
            while len(pending) > in_flight:  # the buffer the next bucket reuses must be loaded by then
                finish(pending.pop(0))
        while pending:
            finish(pending.pop(0))
        return error

    def run_leader(self, plan: SendPlan, own: Callable[[], Iterator], pool: BufferPool) -> None:
        """A stage leader other than the controller: payload bytes of each bucket to the controller."""
        stage = next(s for s in plan.stages if s.leader == self.topo.rank)
        it = own()
        for bplan in stage.buckets:
            try:
                got, slot, buf = next(it)
                assert got is bplan
                self.record(plan, bplan, buf)
                msg = ("ok", self._payloads(plan, bplan, buf))
            except Exception as e:  # noqa: BLE001 - the controller reports it
                slot, msg = None, ("error", f"rank {self.topo.rank}: {type(e).__name__}: {e}")
            t0 = time.perf_counter()
            self.topo.send_object(msg, self.topo.controller)
            self.topo.recv_object(self.topo.controller)
            self.times["deliver"] += time.perf_counter() - t0
            pool.release(slot)
            if msg[0] == "error":
                raise RuntimeError(msg[1])


class DirectTransport(TensorTransport):
    """The colocated delivery of an engine-layout plan (rlhf.weight_bridge.engine_layout.DirectPlan): bucket k's
    buffer holds one section per engine TP rank; engine rank e gets a handle of section e only, and the engine's
    custom loader (rlhf.rollout.engine_loader) copies each region into its parameter."""

    def __init__(self, direct_plan, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.direct = direct_plan

    def _payloads(self, plan: SendPlan, bplan: BucketPlan, buf: torch.Tensor):
        from sglang.srt.utils.common import MultiprocessingSerializer

        stride = self.direct.stride(bplan)
        per_engine = [[MultiprocessingSerializer.serialize(buf[e * stride:e * stride + bplan.nbytes])
                       for e in range(self.tp_size)] for _ in self.initial]
        return self.direct.header(bplan, last=bplan is plan.stages[-1].buckets[-1]), per_engine

    def _send(self, payloads, last: bool):
        header, per_engine = payloads
        by_engine = dict(zip(self.initial, per_engine))
        return self.engines.update_weights_in_engine_layout([by_engine[i] for i in self.targets], header,
                                                            engines=self.targets, flush_cache=last)
