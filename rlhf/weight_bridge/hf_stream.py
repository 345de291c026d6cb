"""The HF tensor stream of a stage: TP gather -> convert -> (name, full HF tensor), and buckets of it.

No rank ever holds the whole model: the gathered shards of one parameter and their converted copy
coexist only while converting it.  Only the stage leader yields; the other TP ranks take part in the
gathers and yield nothing.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Iterator, Sequence

import torch

from parallel.convert import GATHER_DIM, hf_tensors_from_shards
from parallel.model_config import HFModelSpec
from rlhf.weight_bridge.bucketing import BucketPlan, BufferPool, MemoryMeter, fill_buckets
from parallel.convert import LocalTensor

__all__ = ["hf_stream", "stage_buckets", "Threaded", "timed"]


def hf_stream(entries: Sequence[LocalTensor], topo, spec: HFModelSpec,
              meter: MemoryMeter) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(HF name, full tensor, owned)`` on the stage leader; ``owned=False``: the tensor aliases model memory.

    Collective over the TP group (every TP rank must iterate it to the end).
    """
    for e in entries:
        dim = GATHER_DIM[e.role.kind]
        if getattr(topo, "ep_size", 1) > 1 and e.role.is_expert:
            yield from _expert_stream(e, topo, spec, meter)
            continue
        if dim is None:
            if not topo.is_leader:
                continue
            shards = [e.values()]
        else:
            shards = topo.gather(e)
            if not topo.is_leader:
                continue
        gathered = sum(x.nbytes for x in shards) if dim is not None and topo.tp_size > 1 else 0
        try:
            with torch.no_grad():
                outs = hf_tensors_from_shards(e.role, shards, spec)
        finally:
            if dim is not None:
                topo.release_gather()  # every kind with a gather copies in hf_tensors_from_shards
        converted = 0 if dim is None else sum(t.nbytes for _, t in outs)
        meter.alloc(gathered + converted)
        del shards
        meter.free(gathered)
        try:
            while outs:
                name, t = outs.pop(0)
                yield name, t, dim is not None
                del t
        finally:
            del outs
            meter.free(converted)


def _expert_stream(e: LocalTensor, topo, spec: HFModelSpec, meter: MemoryMeter):
    """Expert parallelism: a routed expert tensor of every EP rank.  Each EP rank's TP rank 0 gathers its TP
    shards and converts them; the EP group gathers the results on the stage leader, which yields them in
    EP-rank order under each rank's global expert names (as parallel.convert.iter_hf_tensors does)."""
    from parallel.convert.params import param_role

    shards = topo.gather(e)
    if topo.tp_rank != 0:
        return
    with torch.no_grad():
        outs = hf_tensors_from_shards(e.role, shards, spec)
    del shards
    per_tensor = [topo.gather_experts(t) for _, t in outs]
    del outs
    if not topo.is_leader:
        return
    nbytes = sum(x.nbytes for g in per_tensor for x in g)
    meter.alloc(nbytes)
    try:
        for r in range(topo.ep_size):
            names = param_role(e.local_name, e.chunk, spec, ep_rank=r).hf_names
            for name, gathered in zip(names, per_tensor):
                yield name, gathered[r], True
    finally:
        del per_tensor
        meter.free(nbytes)


class Threaded:
    """Run an iterator in a daemon thread, one item ahead (its exceptions re-raised in the consumer).

    The thread runs on the creating thread's CUDA device: the current CUDA device is per host thread and a
    new thread starts on cuda:0, so without it a stage leader on another GPU (PP > 1: rank s * W / PP) would
    gather its TP shards on cuda:0 (``parallel.devices.group_device`` reads the current device) while its TP
    peers use their own GPUs."""

    _END = object()

    def __init__(self, it: Iterator):
        self.q: queue.Queue = queue.Queue(maxsize=1)
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        threading.Thread(target=self._run, args=(it, device), daemon=True).start()

    def _run(self, it, device=None):
        try:
            if device is not None:
                torch.cuda.set_device(device)
            for x in it:
                self.q.put(x)
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            self.q.put(e)
            return
        self.q.put(self._END)

    def __iter__(self):
        while True:
            x = self.q.get()
            if x is self._END:
                return
            if isinstance(x, BaseException):
                raise x
            yield x


def timed(it: Iterator, times: dict, key: str) -> Iterator:
    """Yield from ``it``, adding the seconds spent waiting for each item to ``times[key]``."""
    while True:
        t0 = time.perf_counter()
        try:
            x = next(it)
        except StopIteration:
            times[key] += time.perf_counter() - t0
            return
        times[key] += time.perf_counter() - t0
        yield x


def stage_buckets(entries: Sequence[LocalTensor], buckets: Sequence[BucketPlan], topo, spec: HFModelSpec,
                  pool: BufferPool, meter: MemoryMeter, overlap: bool,
                  times: dict) -> Iterator[tuple[BucketPlan, int | None, torch.Tensor]]:
    """This stage's buckets ``(plan, pool slot, flat uint8 buffer)`` on the leader (release each slot to the
    pool when done); with ``overlap`` a thread fills bucket k+1 while bucket k is delivered."""
    it = fill_buckets(hf_stream(entries, topo, spec, meter), buckets, pool)
    return timed(iter(Threaded(it)) if overlap else it, times, "produce")
