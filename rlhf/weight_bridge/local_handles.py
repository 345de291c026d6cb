"""Engine-local bucket handles: every colocated engine TP rank loads each bucket from memory on its own device.

Colocated placement (rlhf.rollout.placement.plan_placement) puts engine e's TP rank r on the GPU of trainer global
rank ``e * engine_tp + r`` (trainer rank g on GPU g of rank 0's node).  That rank, the rank's *holder*, receives
every bucket of every pipeline stage from that stage's leader (one broadcast per bucket in the group of the leader
and the holders, on the ranks' own devices: NCCL on a GPU run, gloo on the CPU), serializes ITS copy for its engine
rank and sends the bytes to the controller, which hands engine e the entries ``[from holder(e, 0), from
holder(e, 1), ...]`` (SGLang gives entry i to TP rank i: sglang ``tp_worker.deserialize_own_rank``).  Without it
every engine rank maps the stage leaders' GPUs: a CUDA context on each of them in every engine process and every
bucket read from one GPU (docs/gpu.md, D2).  An engine rank with no trainer rank of its index (more engine ranks
than trainer ranks: CPU tests) is served from the stage leader's buffer.  Extra memory: one bucket pool (the
leader's size and count) on each holder's device; a stage leader that also holds uses its one pool for both, one
stage after the other.

Used with the ``"tensor"`` transport without expert parallelism (with it, the stage leader serializes every entry).

The per-bucket protocol (from_tensor.TensorTransport drives it on the controller and the stage leaders, this
module's :class:`BucketHolder` on the other holders):

1. a stage leader other than the controller reports whether it produced the bucket (``("ok", None)`` or
   ``("error", why)``);
2. the controller decides which engines get the bucket (none after an error; not the engines replaced since the
   sync began) and tells the stage leader and every holder of the stage: nothing is serialized that the
   controller will not hand to an engine (a serialized CUDA IPC handle that is never opened keeps the sender's
   block in torch's IPC limbo for good);
3. with at least one engine: the leader broadcasts the bucket to the holders, each holder serializes its entries
   of those engines and sends them to the controller, which delivers;
4. the controller acks a leader other than itself once the engines answered (the leader may then reuse its buffer);
5. once the engines answered the stage's last bucket, the controller tells the stage's other holders, which then
   give their copies back to their pool (a stage leader that held entries of an earlier stage fills its next
   bucket into that pool).

Ordering: every rank goes through the stages in order and, within a stage, takes the broadcast of bucket k right
after its part in the leader's TP gathers of the last parameter bucket k holds, so all ranks issue the
collectives of the TP groups and of the broadcast groups in one global order (two NCCL communicators never wait
on each other); leaders then produce without the overlap thread.  A holder rewrites a copy only after the
engines loaded the bucket it held: the controller sends the decision of bucket k (step 2), which precedes the
broadcast, only after the engines answered bucket ``k - count`` (its own stage keeps at most ``count - 1`` buckets
in flight, the other stages one, and a stage starts after the previous one was answered), a copy goes back to the
pool only after step 5, and an engine answers once its copies finished (rlhf.rollout.engine_loader.load_bucket).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from parallel.convert import GATHER_DIM, LocalTensor, hf_tensors_from_shards
from rlhf.weight_bridge.bucketing import BucketPlan, BufferPool

__all__ = ["holder_ranks", "entry_tensor_counts", "broadcast_group", "StageServing", "serving_plan", "Copies",
           "BucketHolder"]


def holder_ranks(num_engines: int, engine_tp: int, world: int, leader: int) -> dict[tuple[int, int], int]:
    """``{(engine, engine TP rank): trainer global rank}`` whose device that engine rank runs on: ``e * tp + r``
    (the colocated placement), the stage ``leader`` for an index past the trainer's ``world`` ranks."""
    return {(e, r): (e * engine_tp + r if e * engine_tp + r < world else leader)
            for e in range(num_engines) for r in range(engine_tp)}


def broadcast_group(members: tuple[int, ...], world: int, existing: dict):
    """The process group of one stage's holder broadcasts (its ``members``: the leader and the holders).

    ``torch.distributed.group.WORLD`` when the members are every rank (the colocated recipes: engines x engine TP
    = world), the group of ``existing`` (``{member ranks: group}``, the same keys on every rank, the value
    ``GroupMember.NON_GROUP_MEMBER`` on a rank outside it: megatron's tensor-parallel groups) with exactly these members, else a new group
    (``torch.distributed.new_group``, collective over every rank).  On a GPU run every group is an NCCL
    communicator of its own on each member (~0.5-0.7 GiB of GPU memory each intra-node on A100: NVIDIA/nccl#964,
    #864), made lazily at its first broadcast, i.e. during the first sync with the engines' weights resident;
    sharing one is safe: during a sync these groups carry nothing else, and every member issues the TP gathers
    and the broadcasts in one order (module docstring, "Ordering")."""
    if tuple(members) == tuple(range(world)):
        return dist.group.WORLD
    if tuple(members) in existing:
        return existing[tuple(members)]
    return dist.new_group(ranks=list(members))


def entry_tensor_counts(entries: Sequence[LocalTensor], spec, tp: int) -> list[int]:
    """How many HF tensors each entry converts to on the stage leader (the converter on meta tensors)."""
    out = []
    for e in entries:
        meta = torch.empty(tuple(e.tensor.shape), dtype=e.tensor.dtype, device="meta")
        shards = [meta] if GATHER_DIM[e.role.kind] is None else [meta] * tp
        out.append(len(hf_tensors_from_shards(e.role, shards, spec)))
    return out


@dataclass
class StageServing:
    """Who serializes each engine TP rank's entry of one pipeline stage's buckets.

    Attributes:
        leader: the stage leader's global rank (it fills the buckets).
        holders: ``{(engine, engine TP rank): global rank}``; None: the leader serializes every entry from its
            own buffer (no broadcast).
        group: the broadcast group of the leader and the holders (None without holders).
    """

    leader: int
    holders: dict | None = None
    group: Any = None

    def holder(self, engine: int, tp_rank: int) -> int:
        return self.leader if self.holders is None else self.holders[(engine, tp_rank)]

    def mine(self, rank: int, engines: Sequence[int], tp: int) -> list[tuple[int, int]]:
        """The ``(engine, TP rank)`` entries of ``engines`` that ``rank`` serializes."""
        return [(e, r) for e in engines for r in range(tp) if self.holder(e, r) == rank]

    def participants(self, controller: int) -> list[int]:
        """Ranks the controller exchanges per-bucket messages with: the leader and the holders, itself excluded."""
        ranks = {self.leader} | set((self.holders or {}).values())
        return sorted(ranks - {controller})


def serving_plan(leaders: dict[int, int], holders: dict | None, groups: dict | None = None) -> dict[int, StageServing]:
    """``{pp_rank: StageServing}`` from each stage's leader (``{pp_rank: rank}``), the controller's verdict
    (``{pp_rank: holder map}`` or None) and the broadcast groups (``{pp_rank: group}``)."""
    holders, groups = holders or {}, groups or {}
    return {p: StageServing(leader, holders.get(p), groups.get(p)) for p, leader in leaders.items()}


class Copies:
    """Up to ``count`` bucket copies from ``pool``, reused oldest first (the caller guarantees that the engines
    loaded the bucket a copy held before it is taken again: see the module docstring)."""

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


class BucketHolder:
    """A holder's side of one stage of a sync (not the controller's, not the stage leader's): per bucket, the
    controller's decision, then (when it names engines) the leader's broadcast into a copy on this rank's device
    and this rank's serialized entries to the controller.

    Args:
        topo: the topology (``send_object`` / ``recv_object`` with the controller); serving: the stage's
        StageServing; tp: engine TP size; pool: this rank's bucket pool; count: copies (the controller's buckets
        in flight + 1); serialize: ``serialize(buf, bplan, engine, engine TP rank) -> bytes`` (the transport's
        entry: from_tensor.TensorTransport._entry).
    """

    def __init__(self, topo, serving: StageServing, tp: int, pool: BufferPool, count: int,
                 serialize: Callable[[torch.Tensor, BucketPlan, int, int], bytes]):
        self.topo, self.serving, self.tp, self.serialize = topo, serving, tp, serialize
        self.copies = Copies(pool, count)

    def step(self, bplan: BucketPlan) -> None:
        """Bucket ``bplan``: the decision, then the broadcast and this rank's handles of it."""
        engines = self.topo.recv_object(self.topo.controller)
        if not engines:
            return
        buf = self.copies.take(bplan.nbytes)
        dist.broadcast(buf, src=self.serving.leader, group=self.serving.group)
        mine = self.serving.mine(self.topo.rank, engines, self.tp)
        self.topo.send_object({m: self.serialize(buf, bplan, *m) for m in mine}, self.topo.controller)

    def run(self, buckets: Sequence[BucketPlan], entries: Sequence[LocalTensor] = (), spec=None, tp: int = 1,
            gather: Callable | None = None) -> None:
        """Every bucket in order; ``gather(entry)``: this rank's part in the leader's TP gathers of ``entries``
        (a TP peer of the stage leader, TP size ``tp``), each bucket taken right after the gathers of the last
        entry it holds tensors of.  The copies go back to the pool once the controller says the engines answered
        the stage's last bucket."""
        try:
            counts = entry_tensor_counts(entries, spec, tp) if gather is not None else []
            ends, n = [], 0
            for b in buckets:
                n += len(b.metas)
                ends.append(n)
            done, k = 0, 0
            for e, c in zip(entries, counts):
                gather(e)
                done += c
                while k < len(buckets) and ends[k] <= done:
                    self.step(buckets[k])
                    k += 1
            for b in buckets[k:]:
                self.step(b)
            self.topo.recv_object(self.topo.controller)  # the engines answered this stage's last bucket
        finally:
            self.copies.release_all()
