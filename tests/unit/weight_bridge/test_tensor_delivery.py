"""The colocated transport's engine-local bucket handles (rlhf/weight_bridge/from_tensor.py, with delivery.py's
per-bucket protocol) without processes:
which trainer rank serves which engine TP rank, the order in which a holder takes the controller's decision, its
gathers and the broadcasts, and what the controller serializes and sends per bucket.  Multi-rank runs:
tests/support/dist/holder_checks.py (4 ranks, PP 1 and 2, in-memory engines) and tests/support/dist/bridge_e2e.py
(``*_local_handles_*``, real engines)."""
from __future__ import annotations

import pytest
import torch

from rlhf.rollout.placement import holder_ranks
from rlhf.weight_bridge import from_tensor
from rlhf.weight_bridge.bucketing import BucketPlan, BufferPool, TensorMeta
from rlhf.weight_bridge.from_tensor import BucketHolder, StageServing, TensorDelivery
from rlhf.weight_bridge.plan import SendPlan, StagePlan


def test_holder_is_the_trainer_rank_on_the_engine_ranks_device():
    """Colocated engine e, TP rank r runs on trainer rank e * tp + r's GPU; past the trainer's ranks, the stage
    leader."""
    assert holder_ranks(2, 2, 4, 0) == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}
    assert holder_ranks(2, 2, 2, 0) == {(0, 0): 0, (0, 1): 1, (1, 0): 0, (1, 1): 0}
    assert holder_ranks(2, 2, 3, 2) == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 2}
    assert holder_ranks(1, 1, 1, 0) == {(0, 0): 0}


def test_stage_serving_participants_and_entries():
    """Stage 1 (leader 2) of a TP2 x PP2 trainer serving 2 engines of TP 2: the controller (rank 0) talks to every
    other holder and the leader; the leader serializes engine 1's rank-0 entry; without holders the leader
    serializes every entry and is the only participant."""
    sv = {0: StageServing(0), 1: StageServing(2, holder_ranks(2, 2, 4, 2), "g")}
    assert sv[1].participants(0) == [1, 2, 3] and sv[1].group == "g"
    assert sv[1].mine(2, [0, 1], 2) == [(1, 0)] and sv[1].mine(2, [0], 2) == []
    assert sv[0].participants(0) == [] and sv[0].mine(0, [1], 2) == [(1, 0), (1, 1)]
    assert StageServing(2).participants(0) == [2]


class _Topo:
    """The controller's control messages, recorded; ``replies[src]`` answers recv_object in order."""

    def __init__(self, rank, log, replies=None):
        self.rank, self.controller, self.log, self.replies = rank, 0, log, replies or {}

    def send_object(self, obj, dst):
        self.log.append(("send", dst, sorted(obj) if isinstance(obj, dict) else obj))

    def recv_object(self, src):
        got = self.replies[src].pop(0)
        self.log.append(("recv", src))
        return got(self) if callable(got) else got


def _bucket(index, n):
    metas = [TensorMeta(f"b{index}.t{i}", (2,), torch.float32) for i in range(n)]
    return BucketPlan(index, metas, [8 * i for i in range(n)], 8 * n)


def test_peer_holder_takes_each_broadcast_after_the_gathers_of_its_last_tensor(monkeypatch):
    """Entries convert to 1, 3 and 2 HF tensors, buckets hold 2, 1 and 3: buckets 0 and 1 are complete after the
    second entry's gather, bucket 2 after the third (the leader yields them in that order).  Per bucket the holder
    takes the controller's decision first; a bucket no engine gets (bucket 1) is neither broadcast nor serialized;
    the third bucket reuses the first one's copy (two copies), and only this rank's entries of the decided engines
    are sent.  The copies go back to the pool only after the controller's word that the engines answered the
    stage's last bucket (the pool may next fill this rank's own bucket of a later stage)."""
    log, bufs = [], []

    def broadcast(buf, src, group):
        log.append(("broadcast", src, buf.numel()))
        bufs.append(buf.untyped_storage().data_ptr())

    monkeypatch.setattr(from_tensor.dist, "broadcast", broadcast)
    monkeypatch.setattr(from_tensor, "entry_starts", lambda entries, buckets, spec, tp, ep: [0, 1, 4])
    monkeypatch.setattr(from_tensor, "serialize_bucket", lambda buf, bplan, n: [b"x"] * n)
    pool = BufferPool(48, count=2, shared=True)
    serving = StageServing(0, holder_ranks(2, 2, 4, 0), "group")
    held = []
    answered = lambda topo: held.append(pool._free.qsize())  # noqa: E731 - the copies are still out then
    topo = _Topo(1, log, {0: [[0], [], [0, 1], answered]})
    holder = BucketHolder(topo, serving, 2, pool, 2)
    holder.run([_bucket(0, 2), _bucket(1, 1), _bucket(2, 3)], entries=["e0", "e1", "e2"], spec=None, tp=2,
               gather=lambda e: log.append(("gather", e)))
    assert log == [("gather", "e0"), ("gather", "e1"), ("recv", 0), ("broadcast", 0, 16), ("send", 0, [(0, 1)]),
                   ("recv", 0), ("gather", "e2"), ("recv", 0), ("broadcast", 0, 24), ("send", 0, [(0, 1)]),
                   ("recv", 0)]
    assert held == [0] and pool._free.qsize() == 2
    topo.replies[0] = [[0], [0], [0], True]
    log.clear()
    bufs.clear()
    holder.run([_bucket(0, 2), _bucket(1, 1), _bucket(2, 3)])  # a data-parallel replica's holder: no gathers
    assert [x[0] for x in log] == ["recv", "broadcast", "send"] * 3 + ["recv"]
    assert bufs[2] == bufs[0] != bufs[1]
    assert pool._free.qsize() == 2  # every copy handed back at the end
    pool.close()


def test_controller_decides_before_anyone_serializes(monkeypatch):
    """The controller's own stage with holders: per bucket it sends the decision (the engines that get it) to every
    other holder, then broadcasts, serializes its own entries and takes the others'; engine e's payload is in
    engine-TP-rank order.  After an engine refused bucket 1 there is no decision (None): no broadcast, nothing
    serialized, no engine call (a handle serialized and never opened would keep the block in torch's IPC limbo)."""
    log, serialized, calls = [], [], []
    monkeypatch.setattr(from_tensor.dist, "broadcast", lambda buf, src, group: log.append(("broadcast", src)))
    monkeypatch.setattr(from_tensor, "serialize_bucket",
                        lambda buf, bplan, n: serialized.append(("ctrl", bplan.index)) or [b"c"] * n)

    def holder(rank):  # a holder answering the decision it was sent last: its entries of those engines
        def answer(topo):
            engines = next(x[2] for x in reversed(topo.log) if x[:2] == ("send", rank))
            mine = [m for m in holder_ranks(2, 2, 4, 0).items() if m[1] == rank and m[0][0] in engines]
            serialized.extend(("holder", rank) for _ in mine)
            return {m: f"h{rank}{m}".encode() for m, _ in mine}
        return answer

    class Engines:
        def update_weights_from_tensor(self, rows, engines, load_format, flush_cache):
            calls.append((list(engines), rows))
            if len(calls) == 2:
                raise RuntimeError("engine 0 refused bucket 1")
            return "pending"

        def wait(self, pending, what):
            return []

        def replaced_since(self, token):
            return []

    buckets = [_bucket(k, 1) for k in range(4)]
    plan = SendPlan([StagePlan(0, 0, [], buckets)], [])
    topo = _Topo(0, log, {h: [holder(h)] * 4 for h in (1, 2, 3)})
    serving = {0: StageServing(0, holder_ranks(2, 2, 4, 0), "group")}
    pool = BufferPool(8, count=2)
    tt = TensorDelivery(topo, Engines(), lambda *a: None, {"deliver": 0.0, "receive": 0.0}, [0, 1], 2, (0, 0), serving,
                        pool)
    own = lambda: ((b, *pool.acquire(b.nbytes)) for b in buckets)  # noqa: E731
    error = tt.run_controller(plan, own, pool, in_flight=1)
    assert "engine 0 refused bucket 1" in error
    assert calls[0] == ([0, 1], [[b"c", b"h1(0, 1)"], [b"h2(1, 0)", b"h3(1, 1)"]])
    assert len(calls) == 2 and log.count(("broadcast", 0)) == 2
    assert [x for x in log if x[0] == "send"] == [("send", h, [0, 1]) for h in (1, 2, 3)] * 2 + [
        ("send", h, None) for h in (1, 2, 3)] * 2 + [  # buckets 2 and 3: no decision, nobody serializes
        ("send", h, True) for h in (1, 2, 3)]  # the stage is answered: the holders may reuse their copies
    assert sorted(serialized) == sorted([("ctrl", 0), ("ctrl", 1)] + [("holder", h) for h in (1, 2, 3)] * 2)
    assert sum(len(r) for _, rows in calls for r in rows) == len(serialized)  # every handle made was handed over


def test_replaced_engine_gets_no_more_handles(monkeypatch):
    """An engine replaced during the sync (it dropped its session) is not in the next decisions: nothing is
    serialized for it (the controller's stage leads with no holders: it serializes every entry itself)."""
    made, calls = [], []
    monkeypatch.setattr(from_tensor, "serialize_bucket", lambda buf, bplan, n: made.append(n) or [b"c"] * n)

    class Engines:
        replaced = []

        def update_weights_from_tensor(self, rows, engines, load_format, flush_cache):
            calls.append(list(engines))
            if len(calls) == 1:
                self.replaced = [1]
            return "pending"

        def wait(self, pending, what):
            return []

        def replaced_since(self, token):
            return self.replaced

    buckets = [_bucket(k, 1) for k in range(3)]
    plan = SendPlan([StagePlan(0, 0, [], buckets)], [])
    pool = BufferPool(8, count=2)
    tt = TensorDelivery(_Topo(0, []), Engines(), lambda *a: None, {"deliver": 0.0, "receive": 0.0}, [0, 1], 2, None,
                        {0: StageServing(0)}, pool)
    assert tt.run_controller(plan, lambda: ((b, *pool.acquire(b.nbytes)) for b in buckets), pool, 0) is None
    assert calls == [[0, 1], [0], [0]] and len(made) == 2 * 2 + 2 + 2 and tt.targets == [0]


def test_broadcast_group_reuses_the_world_or_an_existing_group(monkeypatch):
    """A stage whose leader and holders are every rank broadcasts on the world group, one whose members are a
    tensor-parallel group on that group: no new process group, i.e. no second NCCL communicator with the same
    members on a GPU (~0.5-0.7 GiB each, NVIDIA/nccl#964); any other member set gets one new group."""
    import types

    made = []
    fake = types.SimpleNamespace(group=types.SimpleNamespace(WORLD="world"),
                                 new_group=lambda ranks: made.append(ranks) or f"new{ranks}")
    monkeypatch.setattr(from_tensor, "dist", fake)
    tp = {(0, 1): "tp01", (2, 3): "non-member"}
    assert from_tensor.broadcast_group((0, 1, 2, 3), 4, tp) == "world" and made == []
    assert from_tensor.broadcast_group((0, 1), 4, tp) == "tp01" and made == []
    assert from_tensor.broadcast_group((2, 3), 4, tp) == "non-member" and made == []
    assert from_tensor.broadcast_group((0, 2), 4, tp) == "new[0, 2]" and made == [[0, 2]]


def test_a_holder_whose_serialization_raised_still_answers_the_controller(monkeypatch):
    """After a go the controller waits for every participant's entries: a holder whose serialization raised
    (after the broadcast) still sends its (empty) entries, so the controller is not left in its receive and the
    error surfaces as a missing entry (before, the holder left without a word)."""
    log = []
    monkeypatch.setattr(from_tensor.dist, "broadcast", lambda buf, src, group: log.append(("broadcast", src)))

    def broken(buf, bplan, n):
        raise RuntimeError("serializer broke")

    monkeypatch.setattr(from_tensor, "serialize_bucket", broken)
    pool = BufferPool(16, count=2)
    topo = _Topo(1, log, {0: [[0], True]})
    holder = BucketHolder(topo, StageServing(0, holder_ranks(1, 2, 2, 0), "group"), 2, pool, 2)
    with pytest.raises(RuntimeError, match="serializer broke"):
        holder.run([_bucket(0, 1)])
    assert log == [("recv", 0), ("broadcast", 0), ("send", 0, [])]
    assert pool._free.qsize() == 2


def test_the_controller_takes_every_answer_when_its_broadcast_raised(monkeypatch):
    """The controller's broadcast to the holders raises: it still receives every participant's answer (which they
    send after their part), so no stale message is left for the next bucket, and the bucket goes to no engine."""
    log = []

    def broadcast(buf, src, group):
        raise RuntimeError("NCCL error")

    monkeypatch.setattr(from_tensor.dist, "broadcast", broadcast)
    topo = _Topo(0, log, {1: [{(0, 1): b"h"}]})
    pool = BufferPool(8, count=2)
    serving = {0: StageServing(0, holder_ranks(1, 2, 2, 0), "group")}
    d = TensorDelivery(topo, None, lambda *a: None, {"deliver": 0.0, "receive": 0.0}, [0], 2, None, serving, pool)
    buckets = [_bucket(0, 1)]
    error = d.run_controller(SendPlan([StagePlan(0, 0, [], buckets)], []),
                             lambda: ((b, *pool.acquire(b.nbytes)) for b in buckets), pool, in_flight=1)
    assert error == "rank 0: RuntimeError: NCCL error"
    assert log == [("send", 1, [0]), ("recv", 1), ("send", 1, True)]  # the go, its answer, the stage's end
