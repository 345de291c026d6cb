"""The weight sync's steady state (rlhf/weight_bridge/steady.py), single process: a sync whose inputs did not change
reuses the last verdict after one tensor collective, opens the engines' sessions before it, and every change (an
engine restarted with another model, a failed sync, a session that cannot open) plans afresh or stops the sync
before anything is sent.  The multi-rank halves (a TP peer failing its zero-copy writes) run in
tests/support/dist/bridge_e2e.py."""
from __future__ import annotations

import pytest
import torch

import rlhf.weight_bridge.bridge as bridge_module
from rlhf.weight_bridge import WeightBridge, WeightBridgeError
from rlhf.weight_bridge.steady import GO_NONE, GO_OPENED, PlanCache
from tests.support.fakes import FakeEngine, FakeEngines, SimulatedTPTopology, expected_weights_from_spec
from tests.unit.weight_bridge.test_weight_bridge_layout import make_spec, random_hf_state, simulated_trainer


def _bridge(seed=3, **engine_kw):
    spec = make_spec(4, 2, False, False)
    hf = random_hf_state(spec, seed=seed)
    ranks = simulated_trainer(hf, spec, 2)
    engines = FakeEngines(expected_weights_from_spec(spec), **engine_kw)
    topo = SimulatedTPTopology(ranks)
    return WeightBridge(ranks[0], spec, engines, topology=topo, bucket_bytes=4000), engines, topo, hf, ranks


def test_plan_cache_reuses_only_the_digests_of_the_last_successful_sync():
    cache = PlanCache()
    assert cache.decide([[5, 1, GO_NONE], [6, 1, GO_NONE]]) is None  # nothing agreed yet
    cache.planned({"plan": "p"})
    cache.confirm()
    assert cache.predicts_reuse(0, 5) and not cache.predicts_reuse(0, 7)
    assert cache.decide([[5, 1, GO_OPENED], [6, 1, GO_NONE]]) == {"plan": "p", "replanned": False, "groups": None}
    assert cache.decide([[5, 1, GO_OPENED], [7, 1, GO_NONE]]) is None  # rank 1's inputs changed
    assert cache.decide([[5, 1, GO_OPENED], [6, 0, GO_NONE]]) is None  # rank 1 could not list its tensors
    cache.drop()  # a failed sync
    assert cache.decide([[5, 1, GO_NONE], [6, 1, GO_NONE]]) is None and not cache.predicts_reuse(0, 5)


def test_steady_sync_is_one_tensor_collective_and_still_sends_the_new_weights():
    bridge, engines, topo, hf, ranks = _bridge()
    first = bridge.sync()
    assert first.replanned and topo.object_collectives >= 3
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
    engines.log.clear()
    with pytest.raises(WeightBridgeError, match="begin_weight_update failed.*not answering"):
        bridge.sync()
    assert "update_weights_from_tensor" not in engines.log and not engines.engines[0].in_session
    monkeypatch.undo()
    topo.object_collectives = 0
    bridge.sync()  # the failure dropped the cached verdict: planned afresh, then fine
    assert topo.object_collectives > 0


def test_close_drops_the_mappings_of_the_engines_shared_parameters():
    """The trainer's mappings of the engines' arenas go with the bridge (RolloutWorker.close closes it before the
    engines shut down): released at interpreter exit after the engines' torch_shm_manager was gone, a mapping
    raised "Broken pipe" in its destructor and the trainer aborted at exit (exit -6 after a 6-step GRPO run)."""
    import weakref

    bridge, *_ = _bridge()
    storage = torch.UntypedStorage._new_shared(4096)
    bridge.layout_path.maps._maps = [[torch.empty(0, dtype=torch.uint8).set_(storage)]]
    ref = weakref.ref(storage)
    del storage
    assert ref() is not None
    bridge.close()
    assert ref() is None and bridge.layout_path.maps._maps == []


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


def test_plan_between_syncs_makes_the_next_sync_plan_afresh():
    """plan() replaces the engine-layout state (DirectPlan, composed writes) the reused verdict relies on."""
    bridge, engines, topo, hf, _ = _bridge()
    bridge.sync()
    bridge.plan()
    topo.object_collectives = 0
    stats = bridge.sync()
    assert topo.object_collectives > 0, "the sync after plan() reused the verdict of before it"
    assert stats.engines == [0] and _received_all(engines, hf)
    topo.object_collectives = 0
    bridge.sync()  # and then the steady state again
    assert topo.object_collectives == 0


def test_failure_between_the_plan_and_the_delivery_closes_the_sessions_opened_early(monkeypatch):
    """A failure after _plan (the distributed groups' setup) leaves no session open and drops the cached verdict."""
    bridge, engines, topo, hf, _ = _bridge()
    bridge.sync()
    real_plan = bridge._plan

    def plan_with_groups(*args, **kwargs):
        verdict, entries, skipped = real_plan(*args, **kwargs)
        return dict(verdict, groups={}), entries, skipped  # as a fresh plan with group changes would

    def setup_fails(plan, groups, fingerprint):
        raise WeightBridgeError("engine 0 did not join the weight-update group")

    monkeypatch.setattr(bridge, "_plan", plan_with_groups)
    monkeypatch.setattr(bridge.dist, "setup", setup_fails)
    with pytest.raises(WeightBridgeError, match="did not join"):
        bridge.sync()  # steady: the controller opened the sessions before the exchange
    assert not engines.engines[0].in_session, "a session opened early stayed open"
    monkeypatch.undo()
    topo.object_collectives = 0
    bridge.sync()
    assert topo.object_collectives > 0 and _received_all(engines, hf)


@pytest.mark.parametrize("token", ["restarts", "none"])
def test_interrupt_while_the_early_sessions_open_closes_them(monkeypatch, token):
    """A BaseException between start_weight_update and the wait for it (here: while this rank lists its tensors)
    still closes the sessions, also for a fleet whose begin_sync returns None."""
    bridge, engines, topo, hf, _ = _bridge()
    bridge.sync()
    if token == "none":
        monkeypatch.setattr(engines, "begin_sync", lambda: None)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bridge_module, "sync_entries", interrupted)
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
    engines.log.clear()
    with pytest.raises(WeightBridgeError, match=r"engine\(s\) \[0\] replaced while opening.*sync again"):
        bridge.sync()
    assert "update_weights_from_tensor" not in engines.log and not engines.engines[0].in_session
    monkeypatch.undo()
    topo.object_collectives = 0
    stats = bridge.sync()
    assert topo.object_collectives > 0 and stats.engines == [0]
    assert _received_all(engines, hf) and engines.stale_engines() == []


def test_rank_that_cannot_list_its_tensors_still_joins_the_tp_groups_one_time_decision(monkeypatch):
    """The shared-bucket decision is a TP-group collective: a rank whose listing raised takes part (as not usable), and
    the group decides again at the next sync instead of keeping a decision one failure made."""
    bridge, engines, topo, hf, _ = _bridge()
    topo.tp_group, topo.tp_src = "tp group", 0  # the decision runs (recorded below instead of a collective)
    joined = []

    class RecordingSharedBuckets:
        def __init__(self, *args, **kwargs):
            pass

        def usable(self, entries):
            joined.append(None if entries is None else len(entries))
            return False

        def close(self):
            pass

    real_entries = bridge_module.sync_entries

    def listing_fails(*args, **kwargs):
        raise RuntimeError("chunk 0 is offloaded")

    monkeypatch.setattr(bridge_module, "SharedBuckets", RecordingSharedBuckets)
    monkeypatch.setattr(bridge_module, "sync_entries", listing_fails)
    with pytest.raises(WeightBridgeError, match="rank 0: RuntimeError: chunk 0 is offloaded"):
        bridge.sync()
    assert joined == [None], "the failing rank skipped the TP group's collective"
    monkeypatch.setattr(bridge_module, "sync_entries", real_entries)
    stats = bridge.sync()
    assert len(joined) == 2 and joined[1] > 0  # decided again, with this rank's tensors
    assert stats.engines == [0] and _received_all(engines, hf)
    bridge.sync()
    assert len(joined) == 2  # once decided on a good sync, never again


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
