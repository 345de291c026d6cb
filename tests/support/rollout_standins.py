"""Light stand-ins for rlhf.rollout.sglang_engine.SGLangEngine as Ray actors (tests/unit/rollout/test_rollout_manager.py).
They live here, apart from the test module, because a Ray worker imports the module that defines its actor
class: this one imports no torch (the test module's imports cost each engine process ~3 s of CPU)."""
import os
import time

from rlhf.rollout.types import RolloutSample


class StandInEngine:
    """SGLangEngine's interface, in memory; SGLang's rules on release/resume are asserted."""

    def __init__(self, engine_kwargs, index=0, expected_weights=None):
        self.index, self.released = index, set()
        self.rollout_gate = os.path.join(engine_kwargs["model_path"], "rollout_gate")

    def info(self):
        return {"pid": os.getpid(), "index": self.index, "tp_size": 1, "startup_seconds": 0.0, "weight_version": 0}

    def release_memory_occupation(self, tags=None):
        assert not set(tags) & self.released, f"release of released {tags}"
        self.released |= set(tags)

    def resume_memory_occupation(self, tags=None):
        assert set(tags) <= self.released, f"resume of resident {tags}"  # SGLang's scheduler dies on this
        self.released -= set(tags)

    def state(self):
        return sorted(self.released)

    def pause(self, seconds):
        time.sleep(seconds)
        return seconds

    def generate(self, prompts, sampling):
        assert not self.released
        if [99] in prompts:
            raise ValueError("prompt 99 fails")
        if [98] in prompts:  # a long rollout: runs until the test creates the gate file
            deadline = time.time() + 120
            while not os.path.exists(self.rollout_gate):
                assert time.time() < deadline, "the test never released the long rollout"
                time.sleep(0.02)
        return [RolloutSample(list(p), [7], [-0.1], "stop", i, 0, extra={"engine": self.index})
                for i, p in enumerate(prompts)]


class GatedEngine(StandInEngine):
    """A stand-in whose start-up waits until the file ``engine_kwargs["gate"]`` exists (as a real engine takes
    30-100 s to start)."""

    def __init__(self, engine_kwargs, index=0, expected_weights=None):
        while not os.path.exists(engine_kwargs["gate"]):
            time.sleep(0.05)
        super().__init__(engine_kwargs, index, expected_weights)
