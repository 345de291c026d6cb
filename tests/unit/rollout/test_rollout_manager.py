"""RolloutManager's bookkeeping with light stand-in engine actors (real Ray, no SGLang): released tags converge
per engine (a replaced engine starts resident and is brought to the wanted state; nothing resident is ever
resumed), dead engines are replaced and stale once weights were pushed, generation avoids stale engines."""
import os
import time

import pytest
import ray

import rlhf.rollout.manager as manager_mod
from rlhf.rollout.manager import RolloutManager, StaleEnginesError, kill_and_wait
from rlhf.rollout.sampling import SamplingConfig

from tests.support.rollout_standins import GatedEngine, StandInEngine

pytestmark = pytest.mark.slow  # Ray worker processes start in 5-20 s each on a loaded 2-core machine


@pytest.fixture
def mgr(ray_local, tmp_path, monkeypatch):
    from tests.support.tiny_models import make_tiny_hf_model

    make_tiny_hf_model(str(tmp_path), "llama_gqa", vocab_size=64, num_layers=1)
    monkeypatch.setattr(manager_mod, "SGLangEngine", StandInEngine)
    m = RolloutManager(2, dict(model_path=str(tmp_path), device="cpu"), placement="colocated", max_restarts=2)
    yield m
    m.shutdown()


def states(m):
    return [ray.get(a.state.remote()) for a in m.actors]


def test_released_tags_converge_across_a_replacement(mgr):
    mgr.resume_memory_occupation()  # nothing released: nothing sent
    assert states(mgr) == [[], []]
    mgr.release_memory_occupation()
    assert states(mgr) == [["kv_cache", "weights"]] * 2 and mgr.released_tags == ["kv_cache", "weights"]
    with pytest.raises(RuntimeError, match="resume_memory_occupation"):
        mgr.generate([[1, 2]], SamplingConfig(max_new_tokens=1))
    kill_and_wait(mgr.actors[1])
    mgr.resume_memory_occupation(["weights"])  # engine 1 dies in the call: replaced, then brought to the wanted state
    assert mgr.restarts == [0, 1] and states(mgr) == [["kv_cache"], ["kv_cache"]]
    mgr.resume_memory_occupation(["kv_cache"])
    assert states(mgr) == [[], []] and mgr.released_tags == []


def test_dead_engine_is_stale_after_a_push_and_generation_avoids_it(mgr):
    cfg = SamplingConfig(max_new_tokens=1)
    kill_and_wait(mgr.actors[0])
    out = mgr.generate([[1], [2], [3], [4]], cfg)  # before any push: the new engine serves the right weights
    assert [s.prompt_index for s in out] == [0, 1, 2, 3] and mgr.restarts == [1, 0] and mgr.stale_engines() == []
    token = mgr.begin_sync()
    mgr.end_sync(token)
    kill_and_wait(mgr.actors[1])
    out = mgr.generate([[1], [2], [3], [4]], cfg)  # engine 1 replaced and stale: everything on engine 0
    assert mgr.stale_engines() == [1] and {s.extra["engine"] for s in out} == {0} and len(out) == 4
    kill_and_wait(mgr.actors[0])
    with pytest.raises(StaleEnginesError) as ei:
        mgr.generate([[1], [2]], cfg)
    assert ei.value.engines == [0, 1] and ei.value.unfinished == [0, 1] and ei.value.samples == []
    token = mgr.begin_sync()
    assert mgr.replaced_since(token) == []
    mgr.end_sync(token, engines=[1])
    assert mgr.stale_engines() == [0]
    assert {s.extra["engine"] for s in mgr.generate([[1], [2]], cfg)} == {1}


def test_engine_death_fault_point_kills_engine_0_under_the_configured_generate_call(mgr, monkeypatch, caplog):
    """RLHF_FAULT=rollout_engine_death@2: the second generate call finds engine 0 dead (killed as the call starts, not
    before or after it), replaces it and still returns every sample; the first and third calls restart nothing."""
    monkeypatch.setattr(manager_mod.faults, "_hits", {})
    monkeypatch.setenv("RLHF_FAULT", "rollout_engine_death@2")
    monkeypatch.setenv("RLHF_FAULT_RANK", "0")
    cfg, prompts = SamplingConfig(max_new_tokens=1), [[1], [2], [3], [4]]
    old = mgr.actors[0]
    assert len(mgr.generate(prompts, cfg)) == 4 and mgr.restarts == [0, 0]
    with caplog.at_level("WARNING", logger="rlhf.rollout.manager"):
        out = mgr.generate(prompts, cfg)
    assert [s.prompt_index for s in out] == [0, 1, 2, 3] and mgr.restarts == [1, 0] and mgr.actors[0] is not old
    assert "FAULT rollout_engine_death: killing rollout engine 0" in caplog.text
    assert "rollout engine 0 died (generate: " in caplog.text
    assert len(mgr.generate(prompts, cfg)) == 4 and mgr.restarts == [1, 0]


def test_resumed_weights_are_refused_until_a_sync_reaches_them(mgr):
    """SGLang's memory saver keeps no copy of released weights: a resume gives memory back, not the weights.  The
    manager refuses to generate on such engines until a sync reaches them (GPU: garbage; CPU: the same error)."""
    from rlhf.rollout.manager import WeightsDiscardedError

    cfg = SamplingConfig(max_new_tokens=1)
    mgr.release_memory_occupation()
    mgr.resume_memory_occupation()
    assert mgr.weights_discarded() == [0, 1]
    with pytest.raises(WeightsDiscardedError, match=r"\[0, 1\].*sync") as ei:
        mgr.generate([[1]], cfg)
    assert ei.value.engines == [0, 1]
    token = mgr.begin_sync()
    mgr.end_sync(token, engines=[1])  # the sync reached engine 1 only
    with pytest.raises(WeightsDiscardedError, match=r"\[0\]"):
        mgr.generate([[1]], cfg)
    kill_and_wait(mgr.actors[0])
    mgr.info()  # engine 0 replaced: a fresh engine holds its checkpoint's weights (stale, not discarded)
    assert mgr.weights_discarded() == [] and mgr.stale_engines() == [0]
    assert {s.extra["engine"] for s in mgr.generate([[1], [2]], cfg)} == {1}


def test_sync_is_refused_while_generation_runs_or_was_left_running(mgr):
    """The zero-copy sync writes into the engines' parameters with no pause: begin_sync refuses while a generate()
    runs in another thread, and while one that raised left a request running on an engine; once they end it is
    accepted."""
    import threading

    gate = os.path.join(mgr.kwargs["model_path"], "rollout_gate")  # StandInEngine's long rollout ends once it exists
    cfg = SamplingConfig(max_new_tokens=1)
    worker = threading.Thread(target=mgr.generate, args=([[98], [98]], cfg))
    worker.start()
    deadline = time.time() + 30
    while mgr._generating == 0 and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match=r"weight sync refused: 1 generate\(\) call\(s\) in progress"):
        mgr.begin_sync()
    open(gate, "w").close()
    worker.join()
    mgr.end_sync(mgr.begin_sync())
    os.remove(gate)
    with pytest.raises(Exception, match="prompt 99 fails"):
        mgr.generate([[99], [98]], cfg)  # engine 0 fails at once, engine 1 is still generating
    with pytest.raises(RuntimeError, match=r"0 generate\(\) call\(s\) in progress and 1 engine generate call"):
        mgr.begin_sync()
    open(gate, "w").close()
    deadline = time.time() + 30
    while True:  # accepted as soon as engine 1's call ends
        try:
            mgr.end_sync(mgr.begin_sync())
            break
        except RuntimeError:
            assert time.time() < deadline, "the finished engine call still blocks syncs"
            time.sleep(0.1)


def test_launched_engines_start_in_the_background_and_the_first_call_waits(ray_local, tmp_path, monkeypatch):
    """start_rollout launches the engines while the trainer builds its models (rlhf.workers.rollout); the
    manager's first call waits for them."""
    from tests.support.tiny_models import make_tiny_hf_model

    make_tiny_hf_model(str(tmp_path / "m"), "llama_gqa", vocab_size=64, num_layers=1)
    monkeypatch.setattr(manager_mod, "SGLangEngine", GatedEngine)
    gate = tmp_path / "gate"
    m = RolloutManager(2, dict(model_path=str(tmp_path / "m"), device="cpu", engine_overrides={"gate": str(gate)}),
                       start=False)
    try:
        m.launch()  # returns although no engine can finish starting before the gate opens
        assert len(m.actors) == 2 and m.startup_info == []
        gate.touch()
        out = m.generate([[1], [2]], SamplingConfig(max_new_tokens=1))  # waits for both engines
        assert [s.prompt_index for s in out] == [0, 1] and [i["index"] for i in m.startup_info] == [0, 1]
    finally:
        gate.touch()
        m.shutdown()


def test_wait_replaces_only_the_actor_a_call_went_to(mgr):
    """Two calls in flight to engine 1 when it dies (a sync's bucket k+1 dispatched before bucket k's wait): the
    first wait replaces it, the second finds the call's actor already replaced and leaves the new engine alone
    (before, it killed the new engine and started a third)."""
    first = mgr._start(lambda a: a.pause, "pause", 5.0, engines=[1])  # still running when the engine dies
    second = mgr._start(lambda a: a.pause, "pause", 5.0, engines=[1])
    kill_and_wait(mgr.actors[1])
    assert mgr.wait(first) == [None] and mgr.restarts == [0, 1]
    replacement = mgr.actors[1]
    assert mgr.wait(second) == [None] and mgr.restarts == [0, 1] and mgr.actors[1] is replacement
    assert mgr.wait(mgr._start(lambda a: a.state, "state")) == [[], []]


def test_wait_collects_every_call_before_raising(mgr):
    """Engine 0 refuses while engine 1 is still working on the same bucket: wait raises only once engine 1 is done
    too (the caller reuses the bucket's buffer after wait; before, wait raised at engine 0 and left engine 1
    reading it)."""
    pending = (mgr._start(lambda a: a.resume_memory_occupation, "resume", ["weights"], engines=[0])
               + mgr._start(lambda a: a.pause, "pause", 1.0, engines=[1]))
    with pytest.raises(Exception, match="resume of resident"):
        mgr.wait(pending)
    call = pending[1][1]  # (object ref, the engine's restart count at dispatch)
    ready, _ = ray.wait([call[0] if isinstance(call, tuple) else call], timeout=0)
    assert ready and mgr.restarts == [0, 0]
