"""The stage leader's TP gather (MegatronTopology.gather) on two gloo processes: each peer region received straight
into its view of the bucket being filled where that view is contiguous and of the shard's dtype, else into the
pool's receive buffer; the bucket then holds bitwise what gather -> hf_tensors_from_shards -> copy_ gives, for every
kind, an fp32 (in place) and a bf16 bucket (cast from the receive buffer), and an entry whose later HF tensors lie in
the next bucket (not yet acquired: received into the receive buffer); without a pool (the expert path) the parts
materialise the HF tensors."""
import dataclasses
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.convert import ParamRole, hf_tensors_from_shards
from parallel.convert.shard_regions import hf_parts_from_shards, hf_tensors_from_parts
from rlhf.weight_bridge.bucketing import BufferPool, MemoryMeter
from rlhf.weight_bridge.topology import MegatronTopology
from tests.unit.parallel.test_shard_regions import QKV, SPEC, shards_for

CASES = [("vocab", ("e",)), ("row", ("o",)), ("column", ("q_b",)), ("fc1", ("gate", "up")), ("qkv", QKV),
         ("qkv_bias", QKV)]


class _Entry:
    def __init__(self, role, t):
        self.role, self._t = role, t

    def values(self):
        return self._t


def _topology(rank):
    topo = MegatronTopology.__new__(MegatronTopology)
    topo.tp_size, topo.tp_rank, topo.tp_group, topo.tp_ranks = 2, rank, dist.group.WORLD, [0, 1]
    return topo


def _run(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    topo, results = _topology(rank), {}
    for kind, names in CASES:
        shards = shards_for(kind, 2, torch.Generator().manual_seed(11))
        role = ParamRole(kind, names)
        want = hf_tensors_from_shards(role, shards, SPEC)
        for dtype in (torch.float32, torch.bfloat16):
            for split in (False, True):  # True: only the first HF tensor in the bucket being filled
                meter = MemoryMeter()
                pool = BufferPool(1 << 20, meter=meter)
                got = {n: torch.full(t.shape, float("nan"), dtype=dtype) for n, t in want}
                pool.filling = {n: got[n] for n in (names[:1] if split else names)}
                gathered = topo.gather(_Entry(role, shards[rank]), pool, SPEC)
                if rank == 0:
                    pool.filling = {}
                    for name, part in hf_parts_from_shards(role, gathered, SPEC):
                        part.write(got[name])
                    ok = all(torch.equal(got[n].view(torch.uint8), torch.empty_like(got[n]).copy_(t).view(torch.uint8))
                             for n, t in want)
                    results[(kind, dtype, split)] = (ok, meter.peak)
    # a vocabulary of 100 rows: rank 1's 128-row shard is all padding, so it sends nothing and the leader posts nothing
    small, emb = dataclasses.replace(SPEC, vocab_size=100), torch.randn(128, 32, generator=torch.Generator())
    got = torch.zeros(100, 32)
    pool = BufferPool(1 << 20)
    pool.filling = {"e": got}
    gathered = topo.gather(_Entry(ParamRole("vocab", ("e",)), emb if rank == 0 else torch.zeros(128, 32)), pool, small)
    if rank == 0:
        [(_, part)] = hf_parts_from_shards(ParamRole("vocab", ("e",)), gathered, small)
        part.write(got)
        results["padding"] = torch.equal(got, emb[:100])
    fc1 = shards_for("fc1", 2, torch.Generator().manual_seed(5))
    role = ParamRole("fc1", ("gate", "up"))
    whole = topo.gather(_Entry(role, fc1[rank]), spec=SPEC)  # no pool (the expert path): into a new buffer
    if rank == 0:
        results["whole"] = all(torch.equal(a[1], b[1]) for a, b in zip(hf_tensors_from_parts(role, whole, SPEC),
                                                                       hf_tensors_from_shards(role, fc1, SPEC)))
        out.put(results)
    dist.destroy_process_group()


def test_peer_regions_land_in_the_bucket_bitwise():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = out.get(timeout=300)
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert results.pop("whole") and results.pop("padding")
    bad = [k for k, (ok, _) in results.items() if not ok]
    assert not bad, bad
    # fp32, everything in the bucket: the row kind alone (strided columns) goes through the receive buffer
    peak = {k: p for k, (_, p) in results.items()}
    assert peak[("vocab", torch.float32, False)] == 0 and peak[("fc1", torch.float32, False)] == 0
    assert peak[("qkv", torch.float32, False)] == 0
    assert peak[("row", torch.float32, False)] == 32 * 16 * 4  # rank 1's (32 x 16) shard, fp32
    # bf16 bucket: every peer region received into the buffer, then cast
    assert peak[("fc1", torch.bfloat16, False)] == 48 * 32 * 4
    # split fc1: "up" (the second half, 24 x 32 fp32) is not in the bucket being filled
    assert peak[("fc1", torch.float32, True)] == 24 * 32 * 4
