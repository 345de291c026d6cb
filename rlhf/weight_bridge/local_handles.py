"""Engine-local bucket handles: every colocated engine TP rank loads each bucket from memory on its own device.

Colocated placement (rlhf.rollout.placement.plan_placement) puts engine e's TP rank r on the GPU of trainer global
rank ``e * engine_tp + r`` (trainer rank g on GPU g of rank 0's node).  That rank, the rank's *holder*, receives
every bucket from the stage leader (one broadcast per bucket in the group of the leader and the holders, on the
ranks' own devices: NCCL on a GPU run, gloo on the CPU), serializes ITS copy for its engine rank and sends the
bytes to the controller, which hands engine e the entries ``[from holder(e, 0), from holder(e, 1), ...]`` (SGLang
gives entry i to TP rank i: sglang ``tp_worker.deserialize_own_rank``).  Without it every engine rank maps the
leader's GPU: a CUDA context on that GPU in every engine process and every bucket read from that one GPU
(docs/gpu.md, D2).  An engine rank with no trainer rank of its index (more engine ranks than trainer ranks: CPU
tests) is served from the leader's buffer, as before.  Extra memory: one bucket pool (the leader's size and count)
on each holder's device.

Used with the ``"tensor"`` transport at PP 1 without expert parallelism, when the stage leader gathers and packs
(hf_stream.py); the shared-memory buckets (shm_buckets.py, CPU only: there is no device to be wrong about) and
the engine-layout path keep the leader's handles.  Ordering: a holder rewrites a copy only once the engines
loaded the bucket it held (see :class:`BucketHolder`), and a holder that is also a TP peer of the leader takes the
broadcast of bucket k right after its part in the gathers of the last parameter bucket k holds; the leader then
produces its buckets without the overlap thread, so both issue the TP gathers and the broadcasts in one order (two
NCCL communicators never wait on each other), bucket k+1 still produced while the engines load bucket k.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from parallel.convert import GATHER_DIM, LocalTensor, hf_tensors_from_shards
from rlhf.weight_bridge.bucketing import BucketPlan, BufferPool
from rlhf.weight_bridge.from_tensor import TensorTransport, serialize_bucket

__all__ = ["holder_ranks", "entry_tensor_counts", "BucketHolder", "LocalHandleTransport"]


def holder_ranks(num_engines: int, engine_tp: int, world: int, leader: int) -> dict[tuple[int, int], int]:
    """``{(engine, engine TP rank): trainer global rank}`` whose device that engine rank runs on: ``e * tp + r``
    (the colocated placement), the ``leader`` for an index past the trainer's ``world`` ranks."""
    return {(e, r): (e * engine_tp + r if e * engine_tp + r < world else leader)
            for e in range(num_engines) for r in range(engine_tp)}


def entry_tensor_counts(entries: Sequence[LocalTensor], spec, tp: int) -> list[int]:
    """How many HF tensors each entry converts to on the stage leader (the converter on meta tensors)."""
    out = []
    for e in entries:
        meta = torch.empty(tuple(e.tensor.shape), dtype=e.tensor.dtype, device="meta")
        shards = [meta] if GATHER_DIM[e.role.kind] is None else [meta] * tp
        out.append(len(hf_tensors_from_shards(e.role, shards, spec)))
    return out


class BucketHolder:
    """One holder's side of a sync: a copy of each bucket on this rank's device (``count`` copies, reused in turn),
    its serialized handles sent to the controller.

    Reuse needs no message: the controller broadcasts bucket k only after the engines answered bucket
    ``k - count`` (TensorTransport._own_stage keeps at most ``count - 1`` buckets in flight), and an engine answers
    once its copies finished (rlhf.rollout.engine_loader.load_bucket), so the broadcast's data, the first write to
    the copy of bucket ``k - count``, arrives after nothing reads it any more.

    Args:
        topo: the topology (``send_object`` to the controller); group: the broadcast group; leader: the stage
        leader's global rank; mine: the ``(engine, engine TP rank)`` this rank serves; targets: the engines of this
        sync; pool: this rank's bucket pool; count: copies (the controller's buckets in flight + 1).
    """

    def __init__(self, topo, group, leader: int, mine: Sequence[tuple[int, int]], targets: Sequence[int],
                 pool: BufferPool, count: int):
        self.topo, self.group, self.leader, self.pool, self.count = topo, group, leader, pool, count
        self.mine = [m for m in mine if m[0] in set(targets)]
        self.slots: list = []

    def step(self, bplan: BucketPlan) -> None:
        """Receive bucket ``bplan`` from the leader, send this rank's handles of it to the controller."""
        if len(self.slots) >= self.count:
            self.pool.release(self.slots.pop(0))
        slot, buf = self.pool.acquire(bplan.nbytes)
        self.slots.append(slot)
        dist.broadcast(buf, src=self.leader, group=self.group)
        self.topo.send_object({m: serialize_bucket(buf, bplan, 1)[0] for m in self.mine}, self.topo.controller)

    def finish(self) -> None:
        while self.slots:
            self.pool.release(self.slots.pop(0))

    def run(self, buckets: Sequence[BucketPlan], entries: Sequence[LocalTensor] = (), spec=None, tp: int = 1,
            gather: Callable | None = None) -> None:
        """Every bucket in order; ``gather(entry)``: this rank's part in the leader's TP gathers of ``entries``
        (a TP peer), each bucket taken right after the gathers of the last entry it holds tensors of."""
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
        self.finish()


class LocalHandleTransport(TensorTransport):
    """The controller's colocated delivery with holders (PP 1; see module docstring): bucket k is broadcast from
    the controller's buffer to the holders, each engine rank's entry comes from its holder."""

    payloads_always = True

    def __init__(self, holders: dict, group, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.holders, self.group = holders, group
        self.others = sorted({h for h in holders.values() if h != self.topo.rank})

    def _payloads(self, plan, bplan: BucketPlan, buf: torch.Tensor) -> list[list[bytes]]:
        dist.broadcast(buf, src=self.topo.rank, group=self.group)
        got = {}
        for h in self.others:
            got.update(self.topo.recv_object(h))
        out = []
        for e in self.initial:
            row = []
            for r in range(self.tp_size):
                h = self.holders[(e, r)]
                row.append(serialize_bucket(buf, bplan, 1)[0] if h == self.topo.rank else got[(e, r)])
            out.append(row)
        return out
