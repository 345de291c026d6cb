"""The weight sync's plan reuse (rlhf/weight_bridge/bridge.py, WeightBridge._open), single process: the plan is
validated against the engines once and again only when they change (a restart, another model) or a rank's tensors
change; every other sync reuses it after one tensor collective, with the engines' sessions opened before it.  A
failed sync plans afresh; a session that cannot open, or an engine that changed, stops the sync before anything is
sent."""
from __future__ import annotations

import pytest
import torch

import rlhf.weight_bridge.bridge as bridge_module
from rlhf.weight_bridge import WeightBridge, WeightBridgeError, WeightSyncConfig
from tests.support.fakes import FakeEngine, FakeEngines, SimulatedTPTopology, expected_weights_from_spec
from tests.unit.weight_bridge.test_weight_bridge_layout import make_spec, random_hf_state, simulated_trainer


def _bridge(seed=3, **engine_kw):
    spec = make_spec(4, 2, False, False)
    hf = random_hf_state(spec, seed=seed)
    ranks = simulated_trainer(hf, spec, 2)
    engines = FakeEngines(expected_weights_from_spec(spec), **engine_kw)
    topo = SimulatedTPTopology(ranks)
    return (WeightBridge(ranks[0], spec, engines, WeightSyncConfig(bucket_bytes=4000), topology=topo), engines, topo,
            hf, ranks)


def test_a_rank_whose_tensors_changed_plans_afresh(monkeypatch):
    """A rank's listing (names, shapes, dtypes) differs from the one the plan was made with: every rank plans
    afresh (re-validated against the engines) instead of sending by a stale plan."""
    bridge, engines, topo, hf, _ = _bridge()
    assert bridge.sync().replanned and not bridge.sync().replanned
    bridge._plan.tensors_key += 1  # the plan was made with another listing than this rank's now
    engines.log.clear()
    stats = bridge.sync()
    assert stats.replanned and "expected_weights" in engines.log and _received_all(engines, hf)
    assert not bridge.sync().replanned  # and then reused again


def test_steady_sync_is_one_tensor_collective_and_still_sends_the_new_weights():
    bridge, engines, topo, hf, ranks = _bridge()
    first = bridge.sync()
    assert first.replanned and topo.object_collectives == 2  # the reports, the verdict
    for _ in range(2):
        topo.object_collectives = topo.code_collectives = 0
        engines.log.clear()
        stats = bridge.sync()
        assert not stats.replanned and stats.num_buckets == first.num_buckets
        assert topo.object_collectives == 0 and topo.code_collectives == 2  # the codes, the outcome flag
        assert engines.log[0] == "begin_weight_update" and "expected_weights" not in engines.log
    with torch.no_grad():  # the trainer's weights move on: the reused plan sends the new values
        for chunks in ranks:
            for p in chunks[0].parameters():
                p.add_(1.0)
    bridge.sync()
    got = engines.engines[0].received
    assert all(torch.equal(got[n], t + 1.0) for n, t in hf.items()), "the steady sync sent stale values"


def test_engine_changed_between_steady_syncs_is_refused_with_nothing_sent():
    bridge, engines, topo, hf, _ = _bridge()
    bridge.sync()
    bridge.sync()
    engines.restarts[0] += 1  # another engine, serving another model, under the cached plan
    engines.expected["model.norm.weight"] = ((5,), torch.float32)
    engines.log.clear()
    with pytest.raises(WeightBridgeError, match="model.norm.weight"):
        bridge.sync()
    assert engines.log == ["expected_weights"]  # re-validated; no session opened, nothing sent
    assert not engines.engines[0].in_session


def test_failed_sync_drops_the_cached_verdict():
    bridge, engines, topo, hf, _ = _bridge()
    buckets = bridge.sync().num_buckets
    assert buckets >= 2
    engines.fail_at = {(0, buckets + 1)}  # the engine refuses the 2nd bucket of the next sync
    with pytest.raises(WeightBridgeError, match="refused update call"):
        bridge.sync()
    assert not engines.engines[0].in_session
    topo.object_collectives = 0
    stats = bridge.sync()  # planned again (the controller re-validates against its cached SendPlan)
    assert topo.object_collectives > 0 and stats.engines == [0]
    assert all(torch.equal(engines.engines[0].received[n], t) for n, t in hf.items())


def test_session_that_cannot_open_in_the_steady_state_stops_the_sync_before_anything_is_sent(monkeypatch):
    bridge, engines, topo, hf, _ = _bridge()
    bridge.sync()

    def refuse(engines=None):
        raise RuntimeError("engine 0 is not answering")

    monkeypatch.setattr(engines, "start_weight_update", refuse)
    _refused_before_sending(bridge, engines, "begin_weight_update failed.*not answering")
    monkeypatch.undo()
    topo.object_collectives = 0
    stats = bridge.sync()  # nothing was sent and the engines did not change: the plan still holds
    assert not stats.replanned and topo.object_collectives == 0 and _received_all(engines, hf)


def _refused_before_sending(bridge, engines, match):
    """The sync raises WeightBridgeError matching ``match`` with nothing sent and no session left open."""
    engines.log.clear()
    with pytest.raises(WeightBridgeError, match=match):
        bridge.sync()
    assert "update_weights_from_tensor" not in engines.log and not engines.engines[0].in_session


def _received_all(engines, hf):
    return all(torch.equal(engines.engines[0].received[n], t) for n, t in hf.items())


@pytest.mark.parametrize("case", ["bad target list", "fingerprint raises"])
def test_controller_error_before_the_exchange_reaches_every_rank(case):
    """The controller's own inputs (targets, fingerprint) fail before the code exchange: it still takes part (ok=0)
    and every rank raises WeightBridgeError after the exchange, instead of the controller leaving the others in it."""
    bridge, engines, topo, hf, _ = _bridge()
    bridge.sync()
    bridge.sync()  # steady: the controller predicts reuse
    topo.object_collectives = topo.code_collectives = 0
    engines.log.clear()
    if case == "bad target list":
        with pytest.raises(WeightBridgeError, match="rank 0: TypeError"):
            bridge.sync(engines=[0, "x"])
    else:
        healthy = engines.fingerprint
        engines.fingerprint = lambda: (_ for _ in ()).throw(RuntimeError("fleet state lost"))
        with pytest.raises(WeightBridgeError, match="rank 0: RuntimeError: fleet state lost"):
            bridge.sync()
        engines.fingerprint = healthy
    # one code exchange, then the fresh path's reports + verdict broadcast carry the error to every rank
    assert topo.code_collectives == 1 and topo.object_collectives == 2
    assert engines.log == [] and not engines.engines[0].in_session  # no session opened, nothing sent
    stats = bridge.sync()
    assert stats.engines == [0] and _received_all(engines, hf)


def test_unhashable_fleet_fingerprint_still_reaches_the_steady_state():
    """The fingerprint only has to compare with ``!=`` (a tuple holding a list): the digest is not Python's hash."""
    bridge, engines, topo, hf, _ = _bridge()
    engines.fingerprint = lambda: ("model", [list(engines.restarts)])
    assert bridge.sync().replanned
    topo.object_collectives = 0
    stats = bridge.sync()
    assert not stats.replanned and topo.object_collectives == 0 and _received_all(engines, hf)
    engines.restarts[0] += 1  # a restart still changes the digest: planned afresh
    bridge.sync()
    assert topo.object_collectives > 0


def test_plan_validates_without_sessions_and_the_next_sync_reuses_it():
    bridge, engines, topo, hf, _ = _bridge()
    plan = bridge.plan()
    assert plan.num_tensors == len(hf) and engines.log == ["expected_weights"]  # no session, nothing sent
    topo.object_collectives = 0
    stats = bridge.sync()
    assert not stats.replanned and topo.object_collectives == 0
    assert stats.engines == [0] and _received_all(engines, hf)


@pytest.mark.parametrize("when", ["fresh", "steady"])
def test_failure_after_the_sessions_opened_closes_them_and_drops_the_plan(monkeypatch, when):
    """A failure after the sessions opened and before anything was sent (setting up a stage's broadcast group) leaves
    no session open, fresh (opened while planning) or steady (opened before the exchange, then a rank's tensors
    changed), and the next sync plans afresh."""
    bridge, engines, topo, hf, _ = _bridge()
    if when == "steady":
        bridge.sync()
        bridge._plan.tensors_key += 1

    def serving_fails(plan, holders):
        raise WeightBridgeError("engine 0 did not join the weight-update group")

    monkeypatch.setattr(bridge, "_serving", serving_fails)
    engines.log.clear()
    with pytest.raises(WeightBridgeError, match="did not join"):
        bridge.sync()
    assert "begin_weight_update" in engines.log and not engines.engines[0].in_session
    assert "update_weights_from_tensor" not in engines.log
    monkeypatch.undo()
    assert bridge.sync().replanned and _received_all(engines, hf)


@pytest.mark.parametrize("token", ["restarts", "none"])
def test_interrupt_after_the_sessions_opened_closes_them(monkeypatch, token):
    """A BaseException in the exchange after the controller opened the sessions (here: KeyboardInterrupt in the code
    all_gather) still closes them, also for a fleet whose begin_sync returns None."""
    bridge, engines, topo, hf, _ = _bridge()
    bridge.sync()
    if token == "none":
        monkeypatch.setattr(engines, "begin_sync", lambda: None)

    def interrupted(codes):
        raise KeyboardInterrupt

    monkeypatch.setattr(topo, "all_gather_codes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bridge.sync()
    assert engines.log.count("begin_weight_update") == 2 and not engines.engines[0].in_session


@pytest.mark.parametrize("when", ["fresh", "steady"])
def test_engine_replaced_while_its_session_opens_fails_the_sync_before_sending(monkeypatch, when):
    """The manager's wait replaces a dead engine and returns None: the new engine has no session (and would never join
    a distributed group), so the sync stops with nothing sent and the next one plans for the new engine."""
    bridge, engines, topo, hf, _ = _bridge()
    if when == "steady":
        bridge.sync()
    real_start = engines.start_weight_update

    def start_then_die(engines=None):
        pending = real_start(engines=engines)
        fleet = bridge.engines
        fleet.engines[0] = FakeEngine(fleet.expected, fleet.tp_size)  # the manager's replacement: fresh, stale
        fleet.restarts[0] += 1
        fleet.stale.add(0)
        return pending

    monkeypatch.setattr(engines, "start_weight_update", start_then_die)
    _refused_before_sending(bridge, engines, r"engine\(s\) \[0\] replaced while opening.*sync again")
    monkeypatch.undo()
    topo.object_collectives = 0
    stats = bridge.sync()
    assert topo.object_collectives > 0 and stats.engines == [0]
    assert _received_all(engines, hf) and engines.stale_engines() == []


def test_a_rank_that_cannot_list_its_tensors_fails_the_sync_on_every_rank_before_anything_is_sent(monkeypatch):
    bridge, engines, topo, hf, _ = _bridge()
    bridge.sync()
    real_entries = bridge_module.sync_entries

    def listing_fails(*args, **kwargs):
        raise RuntimeError("chunk 0 is offloaded")

    monkeypatch.setattr(bridge_module, "sync_entries", listing_fails)
    _refused_before_sending(bridge, engines, "rank 0: RuntimeError: chunk 0 is offloaded")
    monkeypatch.setattr(bridge_module, "sync_entries", real_entries)
    stats = bridge.sync()
    assert stats.replanned and stats.engines == [0] and _received_all(engines, hf)


@pytest.mark.parametrize("when", ["fresh", "steady"])
def test_a_refused_begin_sync_opens_and_closes_no_session(monkeypatch, when):
    """begin_sync refuses while a generate runs: no session was opened, so none is closed either (an
    end_weight_update would queue behind that generate on the one-call-at-a-time engine actor and block the sync,
    with the other ranks waiting in the exchange); the sync fails naming the refusal and the next one goes through."""
    bridge, engines, topo, hf, _ = _bridge()
    if when == "steady":
        bridge.sync()

    def refuse():
        raise RuntimeError("weight sync refused: 1 generate() call(s) in progress")

    monkeypatch.setattr(engines, "begin_sync", refuse)
    engines.log.clear()
    with pytest.raises(WeightBridgeError, match="refused: 1 generate"):
        bridge.sync()
    assert not {"begin_weight_update", "end_weight_update", "update_weights_from_tensor"} & set(engines.log), \
        engines.log
    monkeypatch.undo()
    bridge.sync()
    assert _received_all(engines, hf)


def test_a_report_that_raises_fails_the_sync_on_every_rank(monkeypatch):
    """A stage leader's report raises (an ``iface:`` address missing on its host, a port): the error goes through
    the planning exchange as WeightBridgeError naming the rank (before, that rank left the exchange and the others
    waited in it for the control group's timeout); nothing is sent."""
    bridge, engines, topo, hf, _ = _bridge()

    def report(entries):
        raise ValueError("rollout.weight_update_address='iface:ib0': no IPv4 address on interface 'ib0'")

    monkeypatch.setattr(bridge, "_report", report)
    _refused_before_sending(bridge, engines, "rank 0: ValueError: .*'ib0'")


def test_close_makes_the_next_sync_plan_afresh():
    bridge, engines, topo, hf, _ = _bridge()
    bridge.sync()
    bridge.close()
    assert bridge.sync().replanned and _received_all(engines, hf)
