"""Engine-local bucket handles (rlhf/weight_bridge/local_handles.py) without processes: which trainer rank serves
which engine TP rank, and the order in which a holder that is a TP peer takes its gathers and broadcasts.
tests/support/dist/bridge_e2e.py (check ``tp2_B_local_handles_*``) runs it with two ranks and a real engine."""
from __future__ import annotations

import torch

from rlhf.weight_bridge import local_handles
from rlhf.weight_bridge.bucketing import BucketPlan, BufferPool, TensorMeta
from rlhf.weight_bridge.local_handles import BucketHolder, LocalHandleTransport, holder_ranks


def test_holder_is_the_trainer_rank_on_the_engine_ranks_device():
    """Colocated engine e, TP rank r runs on trainer rank e * tp + r's GPU; past the trainer's ranks, the leader."""
    assert holder_ranks(2, 2, 4, 0) == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}
    assert holder_ranks(2, 2, 2, 0) == {(0, 0): 0, (0, 1): 1, (1, 0): 0, (1, 1): 0}
    assert holder_ranks(1, 1, 1, 0) == {(0, 0): 0}


class _Topo:
    controller, rank = 0, 1

    def __init__(self, log):
        self.log = log

    def send_object(self, obj, dst):
        self.log.append(("send", dst, sorted(obj)))


def _bucket(index, n):
    metas = [TensorMeta(f"b{index}.t{i}", (2,), torch.float32) for i in range(n)]
    return BucketPlan(index, metas, [8 * i for i in range(n)], 8 * n)


def test_peer_holder_takes_each_broadcast_after_the_gathers_of_its_last_tensor(monkeypatch):
    """Entries convert to 1, 3 and 2 HF tensors, buckets hold 2, 1 and 3: buckets 0 and 1 are complete after the
    second entry's gather, bucket 2 after the third (the leader yields them in that order); the third bucket
    reuses the first one's copy (two copies), and only this rank's engine ranks of this sync's engines are sent."""
    log, bufs = [], []

    def broadcast(buf, src, group):
        log.append(("broadcast", src, buf.numel()))
        bufs.append(buf.untyped_storage().data_ptr())
        buf.fill_(len(bufs))

    monkeypatch.setattr(local_handles.dist, "broadcast", broadcast)
    monkeypatch.setattr(local_handles, "entry_tensor_counts", lambda entries, spec, tp: [1, 3, 2])
    pool = BufferPool(48, count=2, shared=True)
    holder = BucketHolder(_Topo(log), "group", 0, [(0, 1), (1, 1)], targets=[0], pool=pool, count=2)
    holder.run([_bucket(0, 2), _bucket(1, 1), _bucket(2, 3)], entries=["e0", "e1", "e2"], spec=None, tp=2,
               gather=lambda e: log.append(("gather", e)))
    assert log == [("gather", "e0"), ("gather", "e1"), ("broadcast", 0, 16), ("send", 0, [(0, 1)]),
                   ("broadcast", 0, 8), ("send", 0, [(0, 1)]), ("gather", "e2"), ("broadcast", 0, 24),
                   ("send", 0, [(0, 1)])]
    assert bufs[2] == bufs[0] != bufs[1]
    assert pool._free.qsize() == 2  # every copy handed back at the end
    log.clear()  # a data-parallel replica's holder (no TP part): every bucket in order
    holder.run([_bucket(0, 2), _bucket(1, 1)])
    assert [x[0] for x in log] == ["broadcast", "send", "broadcast", "send"] and pool._free.qsize() == 2
    pool.close()


def test_controller_hands_each_engine_rank_its_holders_entry(monkeypatch):
    """Engine e's payload list is in engine-TP-rank order: the controller's own handle where it is the holder,
    else what that holder sent (engine 1's ranks here), for the engines of this sync only."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    monkeypatch.setattr(local_handles.dist, "broadcast", lambda buf, src, group: None)
    received = {2: {(1, 0): b"from2"}, 3: {(1, 1): b"from3"}, 1: {(0, 1): b"from1"}}

    class Topo:
        rank, controller = 0, 0

        def recv_object(self, src):
            return received[src]

    holders = holder_ranks(2, 2, 4, 0)
    tt = LocalHandleTransport(holders, "group", Topo(), None, [1], 2, lambda *a: None, {})
    plan = _bucket(0, 1)
    out = tt._payloads(None, plan, torch.zeros(8, dtype=torch.uint8))
    assert out == [[b"from2", b"from3"]]
    tt = LocalHandleTransport(holders, "group", Topo(), None, [0, 1], 2, lambda *a: None, {})
    own, r1 = tt._payloads(None, plan, torch.zeros(8, dtype=torch.uint8))[0]
    assert r1 == b"from1" and MultiprocessingSerializer.deserialize(own)["flattened_tensor"].numel() == 8
