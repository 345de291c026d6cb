"""SGLangEngine's start-up: the engine class for the configured mode and the garbage-collector freeze after it
(an in-memory stand-in for sglang.Engine; the real engine runs in tests/e2e/test_rollout_engine.py)."""
import rlhf.rollout.sglang_engine as se


class RecordingEngine:
    calls: list = []

    def __init__(self, **kwargs):
        RecordingEngine.calls.append(("init", kwargs.get("skip_tokenizer_init")))

    def freeze_gc(self):
        RecordingEngine.calls.append(("freeze_gc",))


def test_engine_freezes_the_collector_once_started_and_takes_the_token_id_engine(monkeypatch):
    asked = []
    monkeypatch.setattr(se, "engine_class", lambda skip: asked.append(skip) or RecordingEngine)
    RecordingEngine.calls = []
    e = se.SGLangEngine({"model_path": "m", "tp_size": 1, "skip_tokenizer_init": True}, engine_index=3)
    # SGLang's flush_cache (each KV-cache release) runs a full gc.collect() on CPU: freezing after start-up keeps
    # the ~1M start-up objects out of it
    assert RecordingEngine.calls == [("init", True), ("freeze_gc",)] and asked == [True]
    assert e.info()["index"] == 3
    se.SGLangEngine({"model_path": "m", "tp_size": 1})  # text mode when asked for: SGLang's own engine class
    assert asked == [True, False]
