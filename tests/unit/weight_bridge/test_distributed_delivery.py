"""The disaggregated transport's per-bucket decision (rlhf/weight_bridge/delivery.py with
from_distributed.DistributedDelivery) without processes: the engines are asked to receive a bucket only when its stage leader produced it and nothing
failed before, and a leader broadcasts only what the engines were asked for.  Before, the controller asked the
engines for every bucket before knowing whether its leader had produced it, and a leader broadcast whatever the
controller had decided: a production error (a CUDA OOM mid-stage) left the engines waiting in a broadcast that never
came, and a refused request left a leader broadcasting to no one, each until the group's timeout.  The multi-rank
form with real engines: tests/support/dist/bridge_e2e.py (``pp2_A_distributed_production_error_*``)."""
from __future__ import annotations

import pytest
import torch

from rlhf.weight_bridge import from_distributed
from rlhf.weight_bridge.bucketing import BucketPlan, BufferPool, TensorMeta
from rlhf.weight_bridge.from_distributed import DistributedDelivery, DistributedGroups
from rlhf.weight_bridge.plan import SendPlan, StagePlan


class _Topo:
    """Rank ``rank`` of a 2-stage run (controller 0 leads stage 0, rank 1 stage 1); control messages recorded,
    ``replies[src]`` answers recv_object in order."""

    def __init__(self, rank, log, replies=None):
        self.rank, self.controller, self.log, self.replies = rank, 0, log, replies or {}
        self.is_controller = rank == 0

    def send_object(self, obj, dst):
        self.log.append(("send", dst, obj))

    def recv_object(self, src):
        self.log.append(("recv", src))
        return self.replies[src].pop(0)


class _Engines:
    """Records each bucket the engines are asked to receive; ``refuse``: the request of that bucket raises."""

    def __init__(self, log, refuse=None):
        self.log, self.refuse = log, refuse

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, flush_cache, load_format):
        if names[0] == self.refuse:
            raise RuntimeError(f"engine 0 refused {names[0]}")
        self.log.append(("request", group_name, names[0]))
        return [(0, names[0])]

    def wait(self, pending, what):
        self.log.extend(("answered", name) for _, name in pending)
        return [None] * len(pending)


def _plan(per_stage=3):
    stages = []
    for p in range(2):
        buckets = [BucketPlan(k, [TensorMeta(f"s{p}.b{k}", (2,), torch.float32)], [0], 8) for k in range(per_stage)]
        stages.append(StagePlan(p, p, [m for b in buckets for m in b.metas], buckets))
    return SendPlan(stages, [])


class _Delivery(DistributedDelivery):
    """``run``: the controller's or a stage leader's part, as the bridge calls it."""

    def run(self, plan, stage, own, pool):
        if self.topo.is_controller:
            return self.run_controller(plan, own, pool, 0)
        return self.run_leader(plan, stage, own, pool)


def _transport(topo, engines, log, monkeypatch):
    monkeypatch.setattr(from_distributed.dist, "broadcast",
                        lambda buf, src, group: log.append(("broadcast", group, buf[0].item())))
    groups = DistributedGroups(topo, engines, "w", "gloo", None, 60.0)
    groups.pg, groups.group_names = "pg", {0: "g0", 1: "g1"}
    return _Delivery(topo, engines, lambda *a: None, _times(), groups)


def _stream(stage, pool, fail_at=None):
    """A leader's production: bucket k's buffer starts with byte k; from ``fail_at`` on an error in its place (what
    hf_stream.stage_buckets yields after a conversion error); ``consumed`` counts the items taken."""
    consumed = []

    def own():
        for k, b in enumerate(stage.buckets):
            consumed.append(k)
            if fail_at is not None and k >= fail_at:
                yield b, None, RuntimeError(f"CUDA out of memory (bucket {k})")
            else:
                slot, buf = pool.acquire(b.nbytes)
                buf[0] = k
                yield b, slot, buf
    return own, consumed


def _times():
    return {"produce": 0.0, "receive": 0.0, "deliver": 0.0}


@pytest.mark.parametrize("fail_at", [None, 1])
def test_controller_asks_the_engines_only_for_buckets_its_own_stage_produced(monkeypatch, fail_at):
    """The controller's own stage fails at bucket 1 (of 3): bucket 0 is requested, broadcast and answered; buckets 1
    and 2 are neither requested nor broadcast, nor is stage 1 (its leader is told not to broadcast); the stream is
    consumed to its end (the TP peers' gathers) and every buffer goes back; the error names the rank and cause."""
    log = []
    plan = _plan()
    pool = BufferPool(8, count=2)
    own, consumed = _stream(plan.stages[0], pool, fail_at)
    topo = _Topo(0, log, {1: [None, None, None]})
    error = _transport(topo, _Engines(log), log, monkeypatch).run(plan, plan.stages[0], own, pool)
    if fail_at is None:
        assert error is None
        assert [x for x in log if x[0] in ("request", "broadcast")] == [
            ("request", "g0", "s0.b0"), ("broadcast", "pg", 0), ("request", "g0", "s0.b1"), ("broadcast", "pg", 1),
            ("request", "g0", "s0.b2"), ("broadcast", "pg", 2), ("request", "g1", "s1.b0"), ("request", "g1", "s1.b1"),
            ("request", "g1", "s1.b2")]
        assert [x for x in log if x[0] == "send"] == [("send", 1, True), ("send", 1, True)] * 3  # go, then the ack
    else:
        assert error == "rank 0: RuntimeError: CUDA out of memory (bucket 1)"
        assert [x for x in log if x[0] in ("request", "broadcast", "answered")] == [
            ("request", "g0", "s0.b0"), ("broadcast", "pg", 0), ("answered", "s0.b0")]
        assert [x for x in log if x[0] in ("send", "recv")] == [("recv", 1), ("send", 1, None), ("send", 1, True)] * 3
    assert consumed == [0, 1, 2] and pool._free.qsize() == 2


def test_controller_asks_nothing_for_another_stage_whose_leader_failed(monkeypatch):
    """Stage 1's leader reports bucket 1 failed: the engines get stage 1's bucket 0 only; the leader hears True,
    then None for buckets 1 and 2, each followed by the ack; the error is the leader's report."""
    log = []
    plan = _plan()
    pool = BufferPool(8, count=2)
    own, _ = _stream(plan.stages[0], pool)
    topo = _Topo(0, log, {1: [None, "rank 1: RuntimeError: boom", None]})
    error = _transport(topo, _Engines(log), log, monkeypatch).run(plan, plan.stages[0], own, pool)
    assert error == "rank 1: RuntimeError: boom"
    assert [x for x in log if x[0] == "request" and x[1] == "g1"] == [("request", "g1", "s1.b0")]
    assert [x for x in log if x[0] == "send"] == [("send", 1, True), ("send", 1, True), ("send", 1, None),
                                                  ("send", 1, True), ("send", 1, None), ("send", 1, True)]
    assert ("answered", "s1.b0") in log and ("answered", "s1.b1") not in log


def test_a_refused_request_is_not_broadcast_and_nothing_after_it_is_asked(monkeypatch):
    """The engines' request of stage 0's bucket 1 raises: that bucket is not broadcast, nothing later is requested,
    stage 1's leader is told not to broadcast any of its buckets; the error is the refusal."""
    log = []
    plan = _plan()
    pool = BufferPool(8, count=2)
    own, consumed = _stream(plan.stages[0], pool)
    topo = _Topo(0, log, {1: [None, None, None]})
    error = _transport(topo, _Engines(log, refuse="s0.b1"), log, monkeypatch).run(plan, plan.stages[0], own, pool)
    assert error == "rank 0: RuntimeError: engine 0 refused s0.b1"
    assert [x for x in log if x[0] in ("request", "broadcast")] == [("request", "g0", "s0.b0"), ("broadcast", "pg", 0)]
    assert [x for x in log if x[0] == "send"] == [("send", 1, None), ("send", 1, True)] * 3
    assert consumed == [0, 1, 2] and pool._free.qsize() == 2


def test_leader_reports_each_bucket_and_broadcasts_only_when_told(monkeypatch):
    """Stage 1's leader fails at bucket 1: it reports None, then its first error for buckets 1 and 2 (still taking every
    item of its stream: its TP peers' gathers), broadcasts bucket 0 only (the controller's True) and returns its
    error instead of raising it (the controller still waits for its reports)."""
    log = []
    plan = _plan()
    pool = BufferPool(8, count=2)
    own, consumed = _stream(plan.stages[1], pool, fail_at=1)
    topo = _Topo(1, log, {0: [True, True, None, True, None, True]})  # each decision, then the ack
    error = _transport(topo, None, log, monkeypatch).run(plan, plan.stages[1], own, pool)
    failed = "rank 1: RuntimeError: CUDA out of memory (bucket 1)"
    assert error == failed
    assert log == [("send", 0, None), ("recv", 0), ("broadcast", "pg", 0), ("recv", 0),
                   ("send", 0, failed), ("recv", 0), ("recv", 0), ("send", 0, failed), ("recv", 0), ("recv", 0)]
    assert consumed == [0, 1, 2] and pool._free.qsize() == 2


def _failing_broadcast(log, monkeypatch, at):
    def broadcast(buf, src, group):
        if buf[0].item() == at:
            raise RuntimeError("Connection closed by peer")
        log.append(("broadcast", group, buf[0].item()))
    monkeypatch.setattr(from_distributed.dist, "broadcast", broadcast)


def test_a_leader_whose_broadcast_raised_reports_it_and_keeps_the_handshake(monkeypatch):
    """Stage 1's leader: its broadcast of bucket 0 raises (an engine gone, a communicator aborted).  It does not
    leave the sync: it reports the failure with bucket 1 and 2 (the controller then asks nothing more; before, the
    controller waited in a receive the leader never sent), takes every item of its stream and returns the error."""
    log = []
    plan = _plan()
    pool = BufferPool(8, count=2)
    own, consumed = _stream(plan.stages[1], pool)
    t = _transport(_Topo(1, log, {0: [True, True, None, True, None, True]}), None, log, monkeypatch)
    _failing_broadcast(log, monkeypatch, at=0)
    error = t.run(plan, plan.stages[1], own, pool)
    failed = "rank 1: broadcast: RuntimeError: Connection closed by peer"
    assert error == failed
    assert log == [("send", 0, None), ("recv", 0), ("recv", 0), ("send", 0, failed), ("recv", 0), ("recv", 0),
                   ("send", 0, failed), ("recv", 0), ("recv", 0)]
    assert consumed == [0, 1, 2] and pool._free.qsize() == 2


def test_the_controllers_failed_broadcast_stops_the_requests(monkeypatch):
    """The controller's own broadcast of bucket 1 raises: nothing after it is requested, stage 1's leader hears
    None for each of its buckets (then the ack), the error names the broadcast."""
    log = []
    plan = _plan()
    pool = BufferPool(8, count=2)
    own, consumed = _stream(plan.stages[0], pool)
    t = _transport(_Topo(0, log, {1: [None, None, None]}), _Engines(log), log, monkeypatch)
    _failing_broadcast(log, monkeypatch, at=1)
    error = t.run(plan, plan.stages[0], own, pool)
    assert error == "rank 0: broadcast: RuntimeError: Connection closed by peer"
    assert [x for x in log if x[0] in ("request", "broadcast", "answered")] == [
        ("request", "g0", "s0.b0"), ("broadcast", "pg", 0), ("answered", "s0.b0"), ("request", "g0", "s0.b1"),
        ("answered", "s0.b1")]  # the request that was started is still answered
    assert [x for x in log if x[0] == "send"] == [("send", 1, None), ("send", 1, True)] * 3
    assert consumed == [0, 1, 2] and pool._free.qsize() == 2


def test_a_stream_that_ends_early_names_the_bucket(monkeypatch):
    """A leader's stream with fewer buckets than planned: the missing bucket is named, not an empty StopIteration."""
    log = []
    plan = _plan()
    pool = BufferPool(8, count=2)
    t = _transport(_Topo(1, log, {0: [None, True] * 3}), None, log, monkeypatch)
    error = t.run(plan, plan.stages[1], lambda: iter(()), pool)
    assert error == "rank 1: RuntimeError: the stream ended before bucket 0"


class _Replacing(_Engines):
    """Engine 0 is replaced (the manager's wait swaps a dead engine) while bucket ``at`` loads."""

    def __init__(self, log, at):
        super().__init__(log)
        self.at, self.replaced = at, []

    def wait(self, pending, what):
        if any(name == self.at for _, name in pending):
            self.replaced = [0]
        return super().wait(pending, what)

    def replaced_since(self, token):
        return self.replaced


def test_no_bucket_is_asked_of_the_engines_after_one_was_replaced(monkeypatch):
    """An engine replaced during a disaggregated sync is in no weight-update group: the buckets after its
    replacement are neither requested nor broadcast (before, the next request went out and the leader broadcast
    into a group whose member was gone: an NCCL hang), and the error names the engine."""
    log = []
    plan = _plan()
    pool = BufferPool(8, count=2)
    own, consumed = _stream(plan.stages[0], pool)
    engines = _Replacing(log, at="s0.b0")
    d = _transport(_Topo(0, log, {1: [None, None, None]}), engines, log, monkeypatch)
    d.token = "token"
    error = d.run(plan, plan.stages[0], own, pool)
    assert error == "rank 0: RuntimeError: engine(s) [0] replaced during the sync: they are in no weight-update group"
    assert [x for x in log if x[0] in ("request", "broadcast")] == [("request", "g0", "s0.b0"), ("broadcast", "pg", 0)]
    assert consumed == [0, 1, 2] and pool._free.qsize() == 2


def test_group_setup_refuses_an_engine_replaced_while_joining(monkeypatch):
    """The manager's wait replaces an engine that died joining and returns None: setup fails on every rank instead
    of leaving the new engine out of the group the first broadcast then waits on."""
    import sglang.srt.utils.common as common

    monkeypatch.setattr(common, "init_custom_process_group", lambda **kw: "pg")

    class Topo(_Topo):
        is_leader, pp_rank = True, 0

        def broadcast_object(self, obj):
            return obj

        def all_gather_object(self, obj):
            return [obj]

    class Engines:
        tp_size, num_engines, restarts = 1, 1, 0

        def init_weights_update_group(self, *args, **kwargs):
            return [(0, "joining")]

        def wait(self, pending, what):
            self.restarts += 1  # it died joining: replaced
            return [None]

        def fingerprint(self):
            return ("fleet", self.restarts)

        def destroy_weights_update_group(self, name):
            pass

    engines = Engines()
    groups = DistributedGroups(Topo(0, []), engines, "w", "gloo", None, 60.0)
    with pytest.raises(from_distributed.WeightBridgeError, match="rank 0: RuntimeError: an engine was replaced"):
        groups.setup(_plan(), {0: {"addr": "127.0.0.1", "port": 1}, 1: {"addr": "127.0.0.1", "port": 2}},
                     engines.fingerprint())


def test_every_setup_names_its_groups_apart_and_every_rank_the_same(monkeypatch):
    """An engine still holding an earlier bridge's group refuses a new one of the same name (torch's
    _new_process_group_helper): two setups with one prefix name their groups apart, and stage 1's leader joins
    under the name the engines were given (the rendezvous keys carry it; a name made on each rank hung the e2e)."""
    import sglang.srt.utils.common as common

    leaders, engines_joined, sent = [], [], []
    monkeypatch.setattr(common, "init_custom_process_group", lambda **kw: leaders.append(kw["group_name"]) or "pg")

    class Topo(_Topo):
        is_leader = True

        def __init__(self, rank):
            super().__init__(rank, [])
            self.pp_rank = rank

        def broadcast_object(self, obj):  # rank 1 receives what the controller sent
            if self.is_controller:
                sent.append(obj)
            return sent[-1]

        def all_gather_object(self, obj):
            return [obj]

    class Engines:
        tp_size, num_engines = 1, 1

        def init_weights_update_group(self, *args, group_name, **kwargs):
            engines_joined.append(group_name)
            return []

        def wait(self, pending, what):
            return []

        def fingerprint(self):
            return "fleet"

    reports = {0: {"addr": "127.0.0.1", "port": 1}, 1: {"addr": "127.0.0.1", "port": 2}}
    first = [DistributedGroups(Topo(r), Engines() if r == 0 else None, "w", "gloo", None, 60.0) for r in (0, 1)]
    for g in first:
        g.setup(_plan(), reports, "fleet")
    assert leaders == engines_joined[:1] + engines_joined[1:2]  # rank 0 joined stage 0's group, rank 1 stage 1's
    again = DistributedGroups(Topo(0), Engines(), "w", "gloo", None, 60.0)
    again.setup(_plan(), reports, "fleet")
    assert engines_joined[2].startswith("w_") and not set(engines_joined[2:]) & set(engines_joined[:2])
