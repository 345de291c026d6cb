"""Fixed-size buckets of named tensors packed into one flat byte buffer.

The weight bridge streams a model as a sequence of buckets so that no rank ever holds more than
about one bucket of converted weights.  A bucket is a list of `TensorMeta` with byte offsets into
one contiguous ``uint8`` buffer, laid out exactly like SGLang's ``FlattenedTensorBucket``
(tensors back to back, no padding, every offset a multiple of the tensor's element size), so the
same buffer can be sent as one message (p2p, broadcast, ``load_format="flattened_bucket"``) or
handed out as per-tensor views without a copy.

Pure python/torch, no communication: the planning is deterministic, so every rank that knows the
list of tensors (names, shapes, dtypes) computes the same bucket boundaries.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024  # 512 MiB


def dtype_from_any(dtype) -> torch.dtype:
    """torch.dtype from a torch.dtype or a name ("float32", "torch.bfloat16", "bf16").

    Raises ValueError for an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    name = aliases.get(name, name)
    out = getattr(torch, name, None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return out


def dtype_name(dtype) -> str:
    """"float32" for torch.float32 (the spelling SGLang's distributed update takes)."""
    return str(dtype_from_any(dtype)).replace("torch.", "")


@dataclass(frozen=True)
class TensorMeta:
    """Name, shape and dtype of one tensor to send."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


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


#: runs of HF tensors SGLang must receive in ONE ``load_weights`` call (one bucket): its DeepSeek-V2/V3 loader
#: (sglang/srt/models/deepseek_common/deepseek_weight_loader.py) fuses ``q_a_proj`` and ``kv_a_proj_with_mqa``
#: into ``fused_qkv_a_proj_with_mqa`` only when both arrive in the same call and silently drops a half that comes
#: alone, so a bucket boundary between them would leave that layer's fused weight stale.  The pattern's group
#: (match.group(1)) names the run; the tensors between the two (q_a_layernorm, q_b_proj) come along.
KEEP_TOGETHER = (re.compile(r"^(.*\.self_attn\.)(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa)\.weight$"),)


def keep_together_group(name: str) -> str | None:
    """The group of tensors `name` must share a bucket with (:data:`KEEP_TOGETHER`), or None."""
    for pattern in KEEP_TOGETHER:
        m = pattern.match(name)
        if m:
            return m.group(1)
    return None


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[BucketPlan]:
    """Greedily split `metas` (in order) into buckets of at most `bucket_bytes` bytes.

    A tensor larger than `bucket_bytes` gets a bucket of its own (the only way a bucket exceeds
    the limit, with the next case).  A run of consecutive tensors of one :func:`keep_together_group`
    is never split: when it does not fit after what the bucket holds, the run starts a new bucket (and
    fills it alone when it is larger than `bucket_bytes`).  A new bucket is also started when the next
    tensor's byte offset would not be a multiple of its element size (mixed dtypes), so each bucket's
    layout equals SGLang's ``FlattenedTensorBucket`` (no padding).  Every tensor lands in exactly one
    bucket, order kept.

    Raises ValueError for bucket_bytes < 1 or a duplicate tensor name.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    metas = list(metas)
    seen: set[str] = set()
    for m in metas:
        if m.name in seen:
            raise ValueError(f"tensor {m.name!r} appears twice in the send plan")
        seen.add(m.name)
    runs: list[list[TensorMeta]] = []  # consecutive tensors of one keep-together group, else one tensor each
    for m in metas:
        group = keep_together_group(m.name)
        if group is not None and runs and keep_together_group(runs[-1][-1].name) == group:
            runs[-1].append(m)
        else:
            runs.append([m])
    buckets: list[BucketPlan] = []
    cur = BucketPlan(0)
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
    if cur.metas:
        buckets.append(cur)
    return buckets


def bucket_views(buffer: torch.Tensor, plan: BucketPlan) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into the flat uint8 `buffer` for every tensor of `plan` (no copy)."""
    out = []
    for m, off in zip(plan.metas, plan.offsets):
        out.append((m.name, buffer[off:off + m.nbytes].view(m.dtype).view(m.shape)))
    return out


class MemoryMeter:
    """Accounts the bytes the bridge allocates on top of the model (bucket buffers, gathered
    shards, converted tensors).  `peak` is the high-water mark in bytes.  Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> None:
        with self._lock:
            self.current += int(nbytes)
            self.peak = max(self.peak, self.current)

    def free(self, nbytes: int) -> None:
        with self._lock:
            self.current -= int(nbytes)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current


class BufferPool:
    """At most `count` reusable flat uint8 buffers of up to `max_bytes` each.

    `acquire(nbytes)` blocks until a buffer is free (so a producer thread can run at most
    `count` buckets ahead) and returns a view of exactly `nbytes`; `release` gives it back.
    Buffers are allocated lazily, once, and counted in `meter`.
    """

    def __init__(self, max_bytes: int, count: int = 1, device: str | torch.device = "cpu",
                 meter: MemoryMeter | None = None, shared: bool = False):
        import queue

        self.max_bytes = int(max_bytes)
        self.device = torch.device(device)
        # CPU buffers in shared memory from the start: handing them to another process (torch's
        # multiprocessing pickler) then passes a file descriptor instead of copying them into shm
        self.shared = shared and self.device.type == "cpu"
        self.meter = meter or MemoryMeter()
        self._free: "queue.Queue[int]" = queue.Queue()
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._oversize: dict[int, torch.Tensor] = {}
        for i in range(count):
            self._free.put(i)

    def acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """Returns (slot, uint8 view of `nbytes`).  A request above `max_bytes` (a single tensor
        larger than the bucket size) gets a one-off buffer of its own, freed on release."""
        slot = self._free.get()
        buf = self._buffers[slot]
        if nbytes > self.max_bytes:
            oversize = self._new(nbytes)
            self.meter.alloc(nbytes)
            self._oversize[slot] = oversize
            return slot, oversize
        if buf is None:
            buf = self._new(self.max_bytes)
            self.meter.alloc(self.max_bytes)
            self._buffers[slot] = buf
        return slot, buf[:nbytes]

    def _new(self, nbytes: int) -> torch.Tensor:
        if self.shared:
            return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def release(self, slot: int | None) -> None:
        """Give a buffer back (None: a zero-copy bucket, nothing to do)."""
        if slot is None:
            return
        over = self._oversize.pop(slot, None)
        if over is not None:
            self.meter.free(over.numel())
            del over
        self._free.put(slot)

    def close(self) -> None:
        """Drop the buffers (memory is returned once no view is referenced)."""
        for i, b in enumerate(self._buffers):
            if b is not None:
                self.meter.free(b.numel())
                self._buffers[i] = None


class _NoPool:
    """Release target of buckets that own no pool buffer (shared buckets)."""

    def release(self, slot) -> None:
        pass


NO_POOL = _NoPool()


def fill_buckets(named_tensors: Iterable[tuple], plans: Sequence[BucketPlan],
                 pool: BufferPool) -> Iterator[tuple[BucketPlan, int | None, torch.Tensor]]:
    """Copy a stream of (name, tensor[, owned]) into flat buckets following `plans`.

    Yields (plan, pool slot, flat uint8 buffer) once a bucket is complete; the consumer must
    `pool.release(slot)` when done with it.  Each incoming tensor is cast to the planned dtype
    while copying.  A bucket holding one tensor larger than the pool's buffers is sent without a
    copy when the stream marks the tensor `owned` (not aliasing model memory): its bytes are the
    buffer (slot None).  An exception in place of a tensor (a tensor the stream could not produce) is
    raised.  Raises ValueError when the stream disagrees with the plan (name, shape,
    a missing or extra tensor): the plan was validated against the engine, the stream must match.
    """
    it = iter(named_tensors)

    def take(meta: TensorMeta, plan: BucketPlan):
        try:
            item = next(it)
        except StopIteration:
            raise ValueError(f"tensor stream ended before {meta.name!r} (bucket {plan.index})") from None
        name, t = item[0], item[1]
        if isinstance(t, BaseException):  # the stream could not produce this tensor (hf_stream.Production)
            raise t
        if name != meta.name or tuple(t.shape) != tuple(meta.shape):
            raise ValueError(f"tensor stream out of plan: got {name!r} {tuple(t.shape)}, "
                             f"planned {meta.name!r} {tuple(meta.shape)}")
        return t, (len(item) > 2 and bool(item[2]))

    for plan in plans:
        if len(plan.metas) == 1 and plan.nbytes > pool.max_bytes:
            meta = plan.metas[0]
            t, owned = take(meta, plan)
            if owned or t.dtype != meta.dtype:
                t = t.to(meta.dtype).contiguous()
                buf = t.reshape(-1).view(torch.uint8)
                del t
                yield plan, None, buf
                del buf
                continue
            slot, buf = pool.acquire(plan.nbytes)
            try:
                buf.view(meta.dtype).view(meta.shape).copy_(t)
            except BaseException:
                pool.release(slot)
                raise
            del t
            yield plan, slot, buf
            continue
        slot, buf = pool.acquire(plan.nbytes)
        try:
            for meta, (_name, view) in zip(plan.metas, bucket_views(buf, plan)):
                t, _owned = take(meta, plan)
                view.copy_(t)
                del t
        except BaseException:
            pool.release(slot)
            raise
        yield plan, slot, buf
    for extra in it:
        raise ValueError(f"tensor {extra[0]!r} is not in the send plan")
