"""Bounded buckets of named tensors packed into one flat byte buffer, laid out like SGLang's ``FlattenedTensorBucket``
(back to back, every offset a multiple of the tensor's element size): one message (a broadcast) or per-tensor views
without a copy.  Planning is deterministic: every rank that knows the tensors computes the same buckets.
"""
from __future__ import annotations

import math
import queue
import re
import threading
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024

#: runs of HF tensors SGLang must receive in ONE ``load_weights`` call: its DeepSeek-V2/V3 loader
#: (sglang/srt/models/deepseek_common/deepseek_weight_loader.py) fuses ``q_a_proj`` and ``kv_a_proj_with_mqa`` only
#: when both arrive together and silently drops a half that comes alone (the fused weight would stay stale).  The
#: group (match.group(1)) names the run; the tensors between the two come along.
KEEP_TOGETHER = re.compile(r"^(.*\.self_attn\.)(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa)\.weight$")


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one tensor to send."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class BucketPlan:
    """One bucket: tensors in send order, their byte offsets in the flat buffer, total bytes."""

    index: int
    metas: list[TensorMeta] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[BucketPlan]:
    """Greedily split `metas` (in order) into buckets of at most `bucket_bytes` bytes.  A larger tensor gets a bucket
    of its own; a run of one :data:`KEEP_TOGETHER` group is never split (a new bucket when it does not fit, alone when
    larger); a new bucket also starts where the next offset would not be a multiple of the tensor's element size.
    Raises ValueError for bucket_bytes < 1 or a duplicate name."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    runs: list[list[TensorMeta]] = []  # consecutive tensors of one keep-together group, else one tensor each
    seen, last = set(), None
    for m in metas:
        if m.name in seen:
            raise ValueError(f"tensor {m.name!r} appears twice in the send plan")
        seen.add(m.name)
        group = match.group(1) if (match := KEEP_TOGETHER.match(m.name)) else None
        if group is not None and group == last:
            runs[-1].append(m)
        else:
            runs.append([m])
        last = group
    buckets, cur = [], BucketPlan(0)
    for run in runs:
        size = sum(m.nbytes for m in run)
        misaligned = any((cur.nbytes + sum(x.nbytes for x in run[:i])) % m.dtype.itemsize for i, m in enumerate(run))
        if cur.metas and (cur.nbytes + size > bucket_bytes or misaligned):
            buckets.append(cur)
            cur = BucketPlan(len(buckets))
        for m in run:
            if cur.metas and cur.nbytes % m.dtype.itemsize:  # inside a run of mixed dtypes: alignment first
                buckets.append(cur)
                cur = BucketPlan(len(buckets))
            cur.metas.append(m)
            cur.offsets.append(cur.nbytes)
            cur.nbytes += m.nbytes
    return buckets + [cur] if cur.metas else buckets


def bucket_views(buffer: torch.Tensor, plan: BucketPlan) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into the flat uint8 `buffer` for every tensor of `plan` (no copy)."""
    return [(m.name, buffer[off:off + m.nbytes].view(m.dtype).view(m.shape))
            for m, off in zip(plan.metas, plan.offsets)]


class MemoryMeter:
    """The bytes the bridge allocates on top of the model (buffers, gathered shards, converted tensors); ``peak``
    is the high-water mark.  Thread-safe (the producer thread allocates)."""

    def __init__(self):
        self._lock, self.current, self.peak = threading.Lock(), 0, 0

    def alloc(self, nbytes: int) -> None:
        with self._lock:
            self.current += int(nbytes)
            self.peak = max(self.peak, self.current)

    def free(self, nbytes: int) -> None:
        self.alloc(-nbytes)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current


class BufferPool:
    """At most `count` reusable flat uint8 buffers of up to `max_bytes` each, allocated once, lazily, on `device`
    (``shared``: CPU buffers in shared memory, so another process gets a file name, not a copy).  :meth:`acquire`
    blocks until one is free; a request above `max_bytes` (one tensor larger than a bucket) gets a one-off buffer."""

    def __init__(self, max_bytes: int, count: int = 1, device: str | torch.device = "cpu",
                 meter: MemoryMeter | None = None, shared: bool = False):
        self.max_bytes, self.device = int(max_bytes), torch.device(device)
        self.shared = shared and self.device.type == "cpu"
        self.meter = meter or MemoryMeter()
        self._free: queue.Queue[int] = queue.Queue()
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._oversize: dict[int, torch.Tensor] = {}
        self._scratch: torch.Tensor | None = None
        self.filling: dict[str, torch.Tensor] = {}  # fill_buckets
        for i in range(count):
            self._free.put(i)

    def acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """``(slot, uint8 view of nbytes)``; give the slot back with :meth:`release`."""
        slot = self._free.get()
        if nbytes > self.max_bytes:
            self._oversize[slot] = self._new(nbytes)
            return slot, self._oversize[slot]
        if self._buffers[slot] is None:
            self._buffers[slot] = self._new(self.max_bytes)
        return slot, self._buffers[slot][:nbytes]

    def _new(self, nbytes: int) -> torch.Tensor:
        self.meter.alloc(nbytes)
        if self.shared:
            return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def scratch(self, nbytes: int, like: torch.Tensor) -> torch.Tensor:
        """A uint8 view of ``nbytes`` of one reused buffer made as ``like`` (its device; the leader's TP receive
        buffer, valid until the next call), grown to the largest request, kept like the bucket buffers."""
        old = self._scratch.numel() if self._scratch is not None else 0
        if self._scratch is None or old < nbytes or self._scratch.device != like.device:
            self._scratch = None  # freed before the larger one is allocated
            self.meter.alloc(nbytes - old)
            self._scratch = like.new_empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def release(self, slot: int | None) -> None:
        """Give a buffer back (None: a bucket that owns no pool buffer)."""
        if slot is not None:
            self.meter.free(self._oversize.pop(slot).numel() if slot in self._oversize else 0)
            self._free.put(slot)

    def close(self) -> None:
        """Drop the buffers (their memory returns once no view is referenced)."""
        self.meter.free(sum(b.numel() for b in [*self._buffers, self._scratch] if b is not None))
        self._buffers, self._scratch = [None] * len(self._buffers), None


def fill_buckets(named_tensors: Iterable[tuple], plans: Sequence[BucketPlan],
                 pool: BufferPool) -> Iterator[tuple[BucketPlan, int | None, torch.Tensor]]:
    """Write a stream of ``(name, tensor or HFTensorParts[, owned])`` into flat buckets following `plans`, each
    tensor cast to its planned dtype (HFTensorParts: written into its bucket view, which ``pool.filling`` names while
    its bucket is written: the TP gather's receives land there too); yields ``(plan, slot, flat uint8 buffer)`` per
    bucket (the consumer releases the slot).  A bucket of one tensor above the pool's buffers is sent without a copy
    when the stream marks it ``owned`` (slot None).  A streamed exception is raised; ValueError when out of plan."""
    it = iter(named_tensors)

    def take(meta: TensorMeta, plan: BucketPlan):
        item = next(it, None)
        if item is None:
            raise ValueError(f"tensor stream ended before {meta.name!r} (bucket {plan.index})")
        name, t = item[0], item[1]
        if isinstance(t, BaseException):
            raise t
        if name != meta.name or tuple(t.shape) != tuple(meta.shape):
            raise ValueError(f"tensor stream out of plan: got {name!r} {tuple(t.shape)}, "
                             f"planned {meta.name!r} {tuple(meta.shape)}")
        return t, len(item) > 2 and bool(item[2])

    for plan in plans:
        pending = None
        if len(plan.metas) == 1 and plan.nbytes > pool.max_bytes:
            t, owned = take(plan.metas[0], plan)
            if torch.is_tensor(t) and (owned or t.dtype != plan.metas[0].dtype):  # its own copy is the bucket
                buf = t.to(plan.metas[0].dtype).contiguous().reshape(-1).view(torch.uint8)
                del t
                yield plan, None, buf
                del buf
                continue
            pending = [t]
        slot, buf = pool.acquire(plan.nbytes)
        try:
            pool.filling = dict(bucket_views(buf, plan))
            for meta, view in zip(plan.metas, pool.filling.values()):
                t = pending.pop() if pending else take(meta, plan)[0]
                view.copy_(t) if torch.is_tensor(t) else t.write(view)
                del t
        except BaseException:
            pool.release(slot)
            raise
        finally:
            pool.filling = {}
        yield plan, slot, buf
    for extra in it:
        raise ValueError(f"tensor {extra[0]!r} is not in the send plan")
