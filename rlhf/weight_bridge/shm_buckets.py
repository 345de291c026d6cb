"""The single-copy path: every TP rank writes its own shard straight into a shared bucket (CPU, one host).

The stage leader owns ``count`` persistent bucket buffers in shared memory (torch's ``file_system``
strategy: a file name any process can map, so the same buffer is what the engine loads from).  Its TP
peers map them once.  Per bucket, each rank copies (and casts) its shard's regions of the bucket's HF
tensors into place (:mod:`parallel.convert.shard_regions`: q/k/v and gate/up rows are row blocks,
row-parallel shards column blocks), in parallel, then the TP group meets at a barrier and the leader
delivers the bucket.  Gather + convert + pack is one copy, done by all ranks at once; nothing is staged.
With two buffers, bucket k+1 is written while the engines load bucket k: the leader consumes bucket k,
starts its delivery and asks for bucket k+1 with at most ``count - 1`` deliveries in flight, and a barrier
before each reuse of a buffer tells the peers that the bucket it held is loaded.
"""
from __future__ import annotations

import io
import pickle
import socket
from multiprocessing.reduction import ForkingPickler
from collections import defaultdict
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from parallel.convert import LocalTensor
from parallel.convert.shard_regions import shard_regions
from rlhf.weight_bridge.bucketing import BucketPlan, MemoryMeter, bucket_views

__all__ = ["SharedBuckets"]


class SharedBuckets:
    """Persistent shared bucket buffers of one TP group (see module docstring).

    Args:
        tp_group, tp_size, tp_rank, tp_src: the stage's TP group, its size, this rank, its leader's global rank.
        meter: counts the buffers (on the leader) as the sync's extra memory.
        count: buffers (2: write the next bucket while one is delivered).
    """

    def __init__(self, tp_group, tp_size: int, tp_rank: int, tp_src: int, meter: MemoryMeter, count: int = 2):
        self.tp_group, self.tp_size, self.tp_rank, self.tp_src = tp_group, tp_size, tp_rank, tp_src
        self.meter, self.count = meter, count
        self.buffers: list[torch.Tensor] = []
        self.size = 0
        self._usable: bool | None = None

    def usable(self, entries: Sequence[LocalTensor] | None) -> bool:
        """Collective over the TP group (once): CPU tensors and every TP rank on this host.  ``entries`` None: this
        rank could not list its tensors; it still takes part (no peer waits) and the group is not usable."""
        if self._usable is None:
            cpu = entries is not None and all(e.tensor.device.type == "cpu" for e in entries)
            hosts = [None] * self.tp_size
            dist.all_gather_object(hosts, (socket.gethostname(), cpu), group=self.tp_group)
            self._usable = len({h for h, _ in hosts}) == 1 and all(c for _, c in hosts)
        return self._usable

    def ensure(self, nbytes: int) -> None:
        """Collective over the TP group: buffers of at least ``nbytes``, mapped by every rank.

        Raises:
            RuntimeError: on every rank of the group when the leader could not allocate the shared memory (e.g.
                torch's shm manager gone: "Broken pipe"); the leader still takes part in the broadcast, so that
                no peer waits in it."""
        if self.size >= nbytes:
            return
        self.close()
        payload, error = None, None
        if self.tp_rank == 0:
            try:
                torch.multiprocessing.set_sharing_strategy("file_system")
                self.buffers = [torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
                                for _ in range(self.count)]
                self.meter.alloc(nbytes * self.count)
                buf = io.BytesIO()
                ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(self.buffers)
                payload = buf.getvalue()
            except Exception as e:  # noqa: BLE001 - raised on every rank after the broadcast
                self.buffers, error = [], f"{type(e).__name__}: {e}"
        box = [(payload, error)]
        dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
        payload, error = box[0]
        if error is not None:
            raise RuntimeError(f"shared weight-sync buckets of {nbytes} bytes x {self.count} could not be allocated "
                               f"on the stage leader: {error}")
        if self.tp_rank != 0:
            self.buffers = pickle.loads(payload)  # maps the leader's shared memory (no copy)
        self.size = nbytes

    def stream(self, entries: Sequence[LocalTensor], buckets: Sequence[BucketPlan], spec,
               times: dict) -> Iterator[tuple[BucketPlan, None, torch.Tensor]]:
        """Collective over the TP group: write every bucket of the stage; the leader yields
        ``(plan, None, buffer)`` once all ranks wrote it (the peers yield nothing)."""
        regions = defaultdict(list)
        for e in entries:
            for reg in shard_regions(e.role, e.values(), spec, self.tp_rank, self.tp_size):
                regions[reg.name].append(reg)

        def write(_k, bplan, buf):
            for name, view in bucket_views(buf, bplan):
                for reg in regions.get(name, ()):
                    reg.write(view)

        return self._stream(buckets, [b.nbytes for b in buckets], write, times)

    def stream_direct(self, plan, buckets: Sequence[BucketPlan], ops: list, entries: Sequence[LocalTensor],
                      times: dict) -> Iterator[tuple[BucketPlan, None, torch.Tensor]]:
        """Like :meth:`stream`, for the stage's ``buckets`` of an engine-layout plan
        (rlhf.weight_bridge.engine_layout.DirectPlan): each rank runs its composed block copies ``ops[k]`` into
        bucket k's engine-rank sections."""
        from rlhf.weight_bridge.engine_layout import write_section_ops

        flats = [e.values().view(-1) for e in entries]
        sizes = [plan.buffer_bytes(b) for b in buckets]
        return self._stream(buckets, sizes,
                            lambda k, b, buf: write_section_ops(ops[k], buf, plan.stride(b), flats), times)

    def _stream(self, buckets, sizes, write, times):
        import time

        self.ensure(max(sizes, default=1))
        for k, bplan in enumerate(buckets):
            t0 = time.perf_counter()
            if k >= self.count:  # the leader has seen bucket k - count loaded: its buffer is free again
                dist.barrier(group=self.tp_group)
            buf = self.buffers[k % self.count][: sizes[k]]
            with torch.no_grad():
                write(k, bplan, buf)
            dist.barrier(group=self.tp_group)  # bucket k complete
            times["produce"] += time.perf_counter() - t0
            if self.tp_rank == 0:
                yield bplan, None, buf

    def close(self) -> None:
        if self.buffers and self.tp_rank == 0:
            self.meter.free(self.size * self.count)
        self.buffers, self.size = [], 0
