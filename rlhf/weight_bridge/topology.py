"""Ranks and groups of a weight sync.  Stage leader: TP rank 0 of data-parallel (and context-parallel) replica 0 of
each PP stage.  Controller: global rank 0 (the leader of PP stage 0), the only rank holding the engines' handle.
Expert peers (EP > 1): the ranks of the leader's expert-parallel group, which TP-gather and convert their routed
experts for the EP group to gather them on the leader.  Control messages use a gloo group over all ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import devices
from parallel.convert.shard_regions import Gathered, Receipt, peer_regions, shard_regions
from rlhf.weight_bridge.plan import WeightBridgeError

__all__ = ["MegatronTopology"]


class MegatronTopology:
    """Ranks and groups from megatron's parallel_state and torch.distributed."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.active = ps.get_data_parallel_rank(with_context_parallel=True) == 0
        self.is_leader = self.active and self.tp_rank == 0
        self.controller, self.is_controller = 0, self.rank == 0
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.tp_ranks = dist.get_process_group_ranks(self.tp_group)  # global ranks, TP-rank order
        self.ep_size = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank() if self.ep_size > 1 else 0
        self.ep_group = ps.get_expert_model_parallel_group() if self.ep_size > 1 else None
        # expert peer: holds other experts of a leader's stage (expert data-parallel replica 0, not DP replica 0)
        self.expert_peer = (self.ep_size > 1 and not self.active and ps.get_expert_data_parallel_rank() == 0)
        if self.ep_size > 1 and ps.get_expert_tensor_parallel_world_size() != self.tp_size:
            raise WeightBridgeError(f"weight sync with expert_tensor_parallel_size="
                                    f"{ps.get_expert_tensor_parallel_world_size()} != tensor_model_parallel_size="
                                    f"{self.tp_size} is not supported; leave expert_tensor_parallel_size unset")
        if self.is_leader and self.ep_rank != 0:
            raise WeightBridgeError(f"the stage leader (rank {self.rank}) must be expert-parallel rank 0 "
                                    f"(got {self.ep_rank}); use megatron's default rank order")
        self._ctrl = None

    def init_collective(self) -> None:
        """Collective over all ranks: create the gloo control group (once, everyone)."""
        if self._ctrl is None:
            self._ctrl = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def gather(self, entry, pool=None, spec=None) -> list[torch.Tensor] | None:
        """TP shards of ``entry.values()`` on the stage leader, None elsewhere: a Gathered (each peer's shard_regions by
        one batch_isend_irecv, into ``pool.filling``'s bucket views where peer_regions allows, else ``pool.scratch``,
        valid until the next gather, or a new tensor; waited on first write, Region.pending), its own read in place."""
        if self.tp_size == 1:
            return [entry.values().contiguous()]
        t = devices.to_group_device(entry.values().contiguous(), self.tp_group)
        role, tp, got = entry.role, self.tp_size, Receipt(())
        if self.tp_rank != 0:
            ops = [dist.P2POp(dist.isend, g.src, self.tp_ranks[0], self.tp_group)
                   for g in shard_regions(role, t, spec, self.tp_rank, tp)]
            Receipt(dist.batch_isend_irecv(ops) if t.nbytes and ops else ()).wait()  # none: vocabulary padding
            torch.get_device_module(t.device).synchronize(t.device)  # NCCL only enqueued it (keep a merged LoRA input)
            return None
        here = pool is not None and pool.device == devices.group_device(self.tp_group)  # the bucket the group writes
        recv = peer_regions(role, t, spec, tp, got, here and pool.filling.get, pool and (lambda n: pool.scratch(n, t)))
        got.works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, self.tp_ranks[r], self.tp_group)
                                            for r, _, into in recv]) if t.nbytes and recv else []
        return Gathered([t] * tp, shard_regions(role, t, spec, 0, tp) + [g for _, g, _ in recv])

    def gather_experts(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Collective over the EP group: ``t`` of every EP rank (EP-rank order) on the stage leader, None elsewhere."""
        t = devices.to_group_device(t.contiguous(), self.ep_group)
        out = [torch.empty_like(t) for _ in range(self.ep_size)] if self.ep_rank == 0 else None
        dist.gather(t, gather_list=out, dst=dist.get_global_rank(self.ep_group, 0), group=self.ep_group)
        return out

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self._ctrl)
        return out

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=self.controller, group=self._ctrl)
        return box[0]

    def all_gather_codes(self, codes: list[int]) -> list[list[int]]:
        """Every rank's int64 ``codes`` (one length), in rank order: one tensor all_gather, no pickling."""
        t = devices.to_group_device(torch.tensor(codes, dtype=torch.int64), self._ctrl)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self._ctrl)
        return [x.tolist() for x in out]

    def send_object(self, obj, dst: int) -> None:
        dist.send_object_list([obj], dst=dst, group=self._ctrl)

    def recv_object(self, src: int):
        box = [None]
        dist.recv_object_list(box, src=src, group=self._ctrl)
        return box[0]
