"""Colocated transport: ``update_weights_from_tensor`` with SGLang's ``FlattenedTensorBucket``, engine-local handles.

Engine e's TP rank r runs on the GPU of trainer rank ``e * tp + r`` (rlhf.rollout.placement.holder_ranks), its
*holder*: it receives every bucket of every stage by a broadcast from the stage's leader, serializes ITS copy (a CUDA
IPC handle on GPU, a shared-memory file name on CPU) and sends the bytes to the controller, which hands engine e its
ranks' entries in TP-rank order: each engine rank maps memory on its own device only, and only bytes cross Ray (so
stage leaders may sit on any node, expert parallelism too).  An engine rank past the trainer's ranks (CPU tests) gets
the leader's buffer.

Ordering (one global order of the TP gather, EP gather and broadcast groups' collectives, so no rank waits on a
group another rank has not reached): the leader streams its entries in order, each entry's collectives (TP gather;
a routed expert under EP: TP gather, then one EP gather per converted tensor) before any of its HF tensors, and
broadcasts bucket k as soon as k's last tensor is packed, before the next entry's collectives (no overlap thread
while holders hold).  So bucket k's broadcast comes right before the collectives of the first entry whose first HF
tensor (its position in the stage's send order, ``entry_starts``) lies past bucket k.  A holder that also takes part
in the leader's gathers (the leader's TP peer; under EP an expert peer of the stage and its TP peers, whose entries
are only the routed experts, each ``ep`` x its tensors on the leader) takes bucket k's broadcast right before its part
in that entry (BucketHolder.run); other holders take every broadcast in bucket order.  Stages go one after
the other on every rank.  A copy is rewritten only once the engines loaded the bucket it held (the decision of
bucket k comes after their answer to bucket ``k - count``; engine_loader.load_bucket answers after its copies).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from parallel.convert import LocalTensor
from rlhf.weight_bridge.bucketing import BucketPlan, BufferPool
from rlhf.weight_bridge.delivery import Delivery
from rlhf.weight_bridge.plan import plan_local_tensors

__all__ = ["serialize_bucket", "prepare_sharing", "TensorDelivery", "broadcast_group",
           "StageServing", "BucketHolder", "entry_starts"]

def prepare_sharing(device: torch.device) -> None:
    """Buffers of ``device`` shareable by handle: the ``file_system`` strategy on CPU (the engine's schedulers are
    not our children), SGLang's CUDA reductions (device UUIDs; the patch applies itself once) on GPU."""
    if device.type == "cpu":
        torch.multiprocessing.set_sharing_strategy("file_system")
    else:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()


def serialize_bucket(buf: torch.Tensor, bplan: BucketPlan, copies: int) -> list[bytes]:
    """``copies`` serialized FlattenedTensorBucket payloads of the flat uint8 ``buf`` laid out as ``bplan`` (one per
    receiving engine TP rank, each deserialized once).  The bytes reference ``buf``'s memory; they do not copy it."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    metadata = [FlattenedTensorMetadata(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype, start_idx=off,
                                        end_idx=off + m.nbytes, numel=m.nbytes)
                for m, off in zip(bplan.metas, bplan.offsets)]
    return [MultiprocessingSerializer.serialize({"flattened_tensor": buf, "metadata": metadata})
            for _ in range(copies)]


def broadcast_group(members: tuple[int, ...], world: int, existing: dict):
    """The group of one stage's leader and holders (``members``): the world group, a group of ``existing`` (``{member
    ranks: group}``: megatron's TP groups) with these members, else a new one (collective).  Sharing saves an NCCL
    communicator per member (~0.5-0.7 GiB, NVIDIA/nccl#964); during a sync it carries nothing else."""
    members = tuple(members)
    if members == tuple(range(world)):
        return dist.group.WORLD
    return existing[members] if members in existing else dist.new_group(ranks=list(members))


def entry_starts(entries: Sequence[LocalTensor], buckets: Sequence[BucketPlan], spec, tp: int, ep: int) -> list[int]:
    """Position in the stage's send order (``buckets``) of each entry's first HF tensor on the stage leader (for an
    entry with none, of the next tensor); KeyError for an entry the plan does not send."""
    pos = {m.name: i for i, m in enumerate(m for b in buckets for m in b.metas)}
    out, nxt = [], 0
    for e in entries:
        names = [name for name, _, _ in plan_local_tensors([e], spec, tp, ep)]
        out.append(pos[names[0]] if names else nxt)
        nxt = pos[names[-1]] + 1 if names else nxt
    return out


@dataclass
class StageServing:
    """Who serializes each engine TP rank's entry of one stage's buckets: ``holders`` ``{(engine, engine TP rank):
    global rank}`` (None: the ``leader`` serializes every entry from its own buffer) and their broadcast ``group``."""

    leader: int
    holders: dict | None = None
    group: Any = None

    def mine(self, rank: int, engines: Sequence[int], tp: int) -> list[tuple[int, int]]:
        """The ``(engine, TP rank)`` entries of ``engines`` that ``rank`` serializes."""
        return [(e, r) for e in engines for r in range(tp)
                if (self.leader if self.holders is None else self.holders[(e, r)]) == rank]

    def participants(self, controller: int) -> list[int]:
        """Ranks the controller exchanges per-bucket messages with: the leader and the holders, itself excluded."""
        return sorted(({self.leader} | set((self.holders or {}).values())) - {controller})


def _share(topo, sv: StageServing, tp: int, bplan: BucketPlan, engines: list[int], buffer: Callable) -> None:
    """The leader's broadcast of ``bplan`` in ``buffer()``; this rank's entries of ``engines`` to the controller."""
    entries = {}
    try:
        buf = buffer()
        if sv.group is not None:
            dist.broadcast(buf, src=sv.leader, group=sv.group)
        entries = {m: serialize_bucket(buf, bplan, 1)[0] for m in sv.mine(topo.rank, engines, tp)}
    finally:
        topo.send_object(entries, topo.controller)  # also after an error: the controller waits for it


class _Copies:
    """Up to ``count`` bucket copies from ``pool``, reused oldest first (after the engines loaded what it held)."""

    def __init__(self, pool: BufferPool, count: int):
        self.pool, self.count, self.slots = pool, count, []

    def take(self, nbytes: int) -> torch.Tensor:
        if len(self.slots) >= self.count:
            self.pool.release(self.slots.pop(0))
        slot, buf = self.pool.acquire(nbytes)
        self.slots.append(slot)
        return buf

    def release_all(self) -> None:
        while self.slots:
            self.pool.release(self.slots.pop(0))


class TensorDelivery(Delivery):
    """A colocated sync's delivery: the decision is the ``targets`` not replaced since ``begin_sync`` (``token``);
    the controller collects the entries (``serving``: ``{pp_rank: StageServing}``), calls update_weights_from_tensor."""

    def __init__(self, topo, engines, record: Callable, times: dict, targets: list[int], engine_tp: int, token,
                 serving: dict, pool: BufferPool):
        super().__init__(topo, engines, record, times)
        self.targets, self.tp, self.token, self.serving = list(targets), engine_tp, token, serving
        self.copies = _Copies(pool, 1)

    def participants(self, stage) -> list[int]:
        return self.serving[stage.pp_rank].participants(self.topo.rank)

    def start(self, plan, stage, bplan) -> list[int]:
        return list(self.targets)

    def move(self, plan, stage, bplan, buf, engines):
        sv, me, t0, got = self.serving[stage.pp_rank], self.topo.rank, time.perf_counter(), {}
        try:
            if sv.group is not None:
                if buf is None:  # another stage's bucket of which this rank holds entries
                    buf = self.copies.take(bplan.nbytes)
                dist.broadcast(buf, src=sv.leader, group=sv.group)
        finally:
            for rank in sv.participants(me):  # every participant answers a go: take every answer
                got.update(self.topo.recv_object(rank))
            self.times["receive"] += time.perf_counter() - t0
        got.update({m: serialize_bucket(buf, bplan, 1)[0] for m in sv.mine(me, engines, self.tp)})
        rows = [[got[(e, r)] for r in range(self.tp)] for e in engines]
        return self.engines.update_weights_from_tensor(rows, engines=list(engines), load_format="flattened_bucket",
                                                       flush_cache=plan.is_last(stage, bplan))

    def lead(self, stage, bplan, buf, engines) -> None:
        _share(self.topo, self.serving[stage.pp_rank], self.tp, bplan, engines, lambda: buf)

    def wait(self, call) -> None:
        try:
            self.engines.wait(call, "update_weights_from_tensor")
        finally:  # an engine replaced meanwhile has no session open: it stays stale until the next sync
            gone = set(self.engines.replaced_since(self.token))
            self.targets = [i for i in self.targets if i not in gone]

    def stage_done(self, stage) -> None:
        """The holders other than the leader may give their copies back to their pools."""
        sv = self.serving[stage.pp_rank]
        for rank in sv.participants(self.topo.rank):
            if rank != sv.leader:
                self.topo.send_object(True, rank)
        self.copies.release_all()


class BucketHolder:
    """A holder's side of one stage (not the controller's, not the leader's): per bucket the controller's decision,
    then on a go the broadcast into one of ``count`` copies from ``pool`` and this rank's entries to the controller."""

    def __init__(self, topo, serving: StageServing, tp: int, pool: BufferPool, count: int):
        self.topo, self.serving, self.tp, self.copies = topo, serving, tp, _Copies(pool, count)

    def step(self, bplan: BucketPlan) -> None:
        engines = self.topo.recv_object(self.topo.controller)
        if engines:  # a copy that cannot be allocated leaves the leader in the broadcast: not covered (docs/gpu.md)
            _share(self.topo, self.serving, self.tp, bplan, engines, lambda: self.copies.take(bplan.nbytes))

    def run(self, buckets: Sequence[BucketPlan], entries: Sequence[LocalTensor] = (), spec=None, tp: int = 1,
            ep: int = 1, gather: Callable | None = None) -> None:
        """Every bucket in order; on a rank with a part (``gather(entry)``) in the leader's gathers of ``entries``,
        bucket k right before its part in the first entry starting past k (module docstring); the copies go back
        when the stage's last one was answered."""
        try:
            ends = list(itertools.accumulate(len(b.metas) for b in buckets))  # HF tensors through bucket k
            k = 0
            for e, start in zip(entries, entry_starts(entries, buckets, spec, tp, ep)):
                while k < len(buckets) and ends[k] <= start:
                    self.step(buckets[k])
                    k += 1
                gather(e)
            for b in buckets[k:]:
                self.step(b)
            self.topo.recv_object(self.topo.controller)  # the engines answered this stage's last bucket
        finally:
            self.copies.release_all()
