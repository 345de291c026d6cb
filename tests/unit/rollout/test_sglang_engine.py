"""SGLangEngine's start-up: the engine class for the configured mode and the garbage-collector freeze after it
(an in-memory stand-in for sglang.Engine; the real engine runs in tests/e2e/test_rollout_engine.py)."""
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
