"""Same-host TP gather through shared memory (CPU).

gloo moves a few hundred MB/s over loopback TCP on a busy host; with all TP ranks of a stage on one
host each non-leader instead copies its shards into a /dev/shm staging file the leader has mapped
(one memcpy on each side), packing consecutive parameters up to ``STAGING_BYTES`` (or the largest
shard), and the ranks exchange two tiny barriers per pack.  Staging files are unlinked as soon as
every rank mapped them, so nothing is left behind in /dev/shm.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from rlhf.mcore.convert import GATHER_DIM

__all__ = ["ShmGather", "STAGING_BYTES"]

STAGING_BYTES = 128 * 1024 * 1024


class ShmGather:
    """The shared-memory gather of one TP group (collective set-up in :meth:`prepare`).

    Args:
        tp_group, tp_size, tp_rank, rank: this rank's TP group and position; ``rank`` is the global rank.
    """

    def __init__(self, tp_group, tp_size: int, tp_rank: int, rank: int):
        self.tp_group, self.tp_size, self.tp_rank, self.rank = tp_group, tp_size, tp_rank, rank
        self._state: dict | None = None
        self._packs: dict | None = None
        self._entries: Sequence[Any] = ()
        self.last_in_pack = False
        self.disabled = False

    @property
    def active(self) -> bool:
        return self._packs is not None

    def prepare(self, entries: Sequence[Any]) -> None:
        """Collective over the TP group: plan the packs of this sync's gathered entries and map the
        staging files (once, or again when a larger one is needed).  Leaves the gather inactive for
        non-CPU tensors, ranks on several hosts, or nothing to gather."""
        self._packs = None
        if self.disabled or self.tp_size == 1 or not os.path.isdir("/dev/shm"):
            return
        if {e.tensor.device.type for e in entries} - {"cpu"}:
            return
        gathered = [(i, e.tensor.nbytes) for i, e in enumerate(entries) if GATHER_DIM[e.role.kind] is not None]
        if not gathered:
            return
        cap = max(max(n for _, n in gathered), min(sum(n for _, n in gathered), STAGING_BYTES))
        packs, cur, off = {}, [], 0  # deterministic, identical on every TP rank (same entries and shapes)
        for i, n in gathered:
            if cur and off + n > cap:
                cur, off = [], 0
            cur.append(i)
            packs[id(entries[i])] = (cur, off)
            off += n
        self._entries = entries
        if self._state is None or self._state["size"] < cap:
            hosts = [None] * self.tp_size
            dist.all_gather_object(hosts, socket.gethostname(), group=self.tp_group)
            if len(set(hosts)) > 1:
                self.disabled = True
                return
            self._state = self._map(cap)
        self._packs = packs

    def _map(self, cap: int) -> dict:
        name = None
        if self.tp_rank != 0:
            name = f"/dev/shm/rlhf_weight_sync_{os.getpid()}_{self.rank}_{time.time_ns()}"
            with open(name, "wb") as f:
                f.truncate(cap)
            staging = torch.from_file(name, shared=True, size=cap, dtype=torch.uint8)
        names = [None] * self.tp_size
        dist.all_gather_object(names, name, group=self.tp_group)
        state: dict = {"size": cap}
        if self.tp_rank == 0:
            state["peers"] = [torch.from_file(n, shared=True, size=cap, dtype=torch.uint8) for n in names[1:]]
        else:
            state["staging"] = staging
        dist.barrier(group=self.tp_group)
        if name is not None:
            os.unlink(name)  # the mappings stay valid
        return state

    def gather(self, entry: Any) -> list[torch.Tensor] | None:
        """TP shards of ``entry.tensor`` (rank order) on the leader (views into staging memory, valid until
        :meth:`release`), None on the other ranks."""
        t = entry.tensor.detach().contiguous()
        pack, off = self._packs[id(entry)]
        first = self._entries[pack[0]] is entry
        if self.tp_rank != 0:
            if first:  # stage the whole pack, then wait until the leader has read it
                staging = self._state["staging"]
                for i in pack:
                    e = self._entries[i]
                    src = e.tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                    _, o = self._packs[id(e)]
                    staging[o:o + src.numel()].copy_(src)
                dist.barrier(group=self.tp_group)  # pack staged
                dist.barrier(group=self.tp_group)  # leader done with it
            return None
        if first:
            dist.barrier(group=self.tp_group)
        self.last_in_pack = self._entries[pack[-1]] is entry
        return [t] + [p[off:off + t.nbytes].view(t.dtype).view(t.shape) for p in self._state["peers"]]

    def release(self) -> None:
        """Leader: the shards of the last gather are no longer needed (ends the pack when it was its last)."""
        if self.last_in_pack:
            dist.barrier(group=self.tp_group)
            self.last_in_pack = False
