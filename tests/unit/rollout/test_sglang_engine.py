"""SGLangEngine's start-up: the engine class for the configured mode and the garbage-collector freeze after it
(an in-memory stand-in for sglang.Engine; the real engine runs in tests/e2e/test_rollout_engine.py)."""
import pytest

import rlhf.rollout.sglang_engine as se


class RecordingEngine:
    calls: list = []

    def __init__(self, **kwargs):
        RecordingEngine.calls.append(("init", kwargs.get("skip_tokenizer_init")))

    def freeze_gc(self):
        RecordingEngine.calls.append(("freeze_gc",))


def test_engine_freezes_the_collector_once_started_and_takes_the_engine_class_for_its_device(monkeypatch):
    asked = []
    monkeypatch.setattr(se, "engine_class", lambda skip, fork_schedulers=False: asked.append((skip, fork_schedulers))
                        or RecordingEngine)
    RecordingEngine.calls = []
    e = se.SGLangEngine({"model_path": "m", "tp_size": 1, "skip_tokenizer_init": True, "device": "cpu"},
                        engine_index=3)
    # SGLang's flush_cache (each KV-cache release) runs a full gc.collect() on CPU: freezing after start-up keeps
    # the ~1M start-up objects out of it
    assert RecordingEngine.calls == [("init", True), ("freeze_gc",)] and asked == [(True, True)]
    assert e.info()["index"] == 3
    se.SGLangEngine({"model_path": "m", "tp_size": 1, "device": "cuda"})  # GPU: SGLang's spawned schedulers
    assert asked == [(True, True), (False, False)]


_PARENT_STATE = []


def _report_parent_state(queue):
    queue.put(list(_PARENT_STATE))


def test_forked_subprocesses_share_the_parents_state_and_restore_the_start_method():
    import multiprocessing as mp

    from rlhf.rollout.sglang_cpu import forked_subprocesses

    before = mp.get_start_method(allow_none=True)
    mp.set_start_method("spawn", force=True)  # what SGLang sets before it starts its schedulers
    try:
        _PARENT_STATE[:] = ["imported once"]  # a spawned child re-imports this module and sees []
        with forked_subprocesses():
            queue = mp.SimpleQueue()
            child = mp.Process(target=_report_parent_state, args=(queue,))
            child.start()
            got = queue.get()
            child.join(60)
        assert got == ["imported once"] and child.exitcode == 0
        assert mp.get_start_method() == "spawn"
    finally:
        mp.set_start_method(before, force=True)


class SessionEngine(RecordingEngine):
    """sglang.Engine's weight-update session rules (scheduler_components/weight_updater.py): one session at a time,
    end refused when none is open, a tensor update refused outside one."""

    def __init__(self, **kwargs):
        self.open = False

    def begin_weight_update(self):
        if self.open:
            return False, "a weight-update session is already open"
        self.open = True
        return True, "Success"

    def end_weight_update(self):
        ok, self.open = self.open, False
        return (True, "Success") if ok else (False, "no weight-update session is open")

    def update_weights_from_tensor(self, **kwargs):
        return (True, "Success") if self.open else (False, "no weight-update session is open")


def test_a_refused_end_closes_the_session_so_the_next_sync_opens_a_fresh_one(monkeypatch):
    monkeypatch.setattr(se, "engine_class", lambda skip, fork_schedulers=False: SessionEngine)
    e = se.SGLangEngine({"model_path": "m", "tp_size": 1, "device": "cpu"})
    end = e.engine.end_weight_update

    def end_once_refused():  # SGLang's session went away under us: its end refuses
        e.engine.open = False
        e.engine.end_weight_update = end
        return end()

    e.begin_weight_update()
    e.update_weights_from_tensor([b"bucket"], load_format="direct")
    e.engine.end_weight_update = end_once_refused
    with pytest.raises(se.EngineCallError, match="end_weight_update failed: no weight-update session is open"):
        e.end_weight_update()
    assert e.weight_version == 0  # the failed sync is not counted
    # the actor counts the session closed: a load now is refused here (before, the actor stayed "in a session" and
    # sent it to SGLang, which refused it outside one), and the next sync opens a fresh session: version 1
    with pytest.raises(se.EngineCallError, match="must run between begin_weight_update"):
        e.update_weights_from_tensor([b"bucket"], load_format="direct")
    e.begin_weight_update()
    e.update_weights_from_tensor([b"bucket"], load_format="direct")
    assert e.end_weight_update() == 1
    assert not e.engine.open
