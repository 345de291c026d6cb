"""The weight sync's steady state (rlhf/weight_bridge/steady.py), single process: a sync whose inputs did not change
reuses the last verdict after one tensor collective, opens the engines' sessions before it, and every change (an
engine restarted with another model, a failed sync, a session that cannot open) plans afresh or stops the sync
before anything is sent.  The multi-rank halves (a TP peer failing its zero-copy writes) run in
tests/support/dist/bridge_e2e.py."""
from __future__ import annotations

import pytest
import torch

from rlhf.weight_bridge import WeightBridge, WeightBridgeError
from rlhf.weight_bridge.steady import GO_NONE, GO_OPENED, PlanCache
from tests.support.fakes import FakeEngines, SimulatedTPTopology, expected_weights_from_spec
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
