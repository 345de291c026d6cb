"""The trainer's RolloutWorker drives the colocated engine lifecycle in GPU order on every device:
generate (engines resident) -> release -> train -> resume weights -> sync -> resume KV cache, so validation right
after a step generates on resident engines and weights are never synced into released memory.  One process
(world size 1), the engines and the weight bridge replaced by stand-ins (tests/support/fakes.py)."""
import socket

import pytest
import torch.distributed as dist

import rlhf.workers.rollout as rollout_mod
from rlhf.config import compose_config
from tests.support.fakes import FakeRolloutManager, RecordingBridge


@pytest.fixture
def world1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def worker(world1, tmp_path, monkeypatch):
    from tests.support.tiny_models import make_tiny_hf_model
    from tests.support.tiny_tokenizer import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    make_tiny_hf_model(str(tmp_path), "llama_gqa", vocab_size=len(tok), num_layers=1, tokenizer=tok)
    manager = FakeRolloutManager()
    monkeypatch.setattr(rollout_mod, "start_rollout", lambda cfg, path: manager)
    import rlhf.weight_bridge as ws

    monkeypatch.setattr(ws, "WeightBridge", lambda chunks, spec, engines, **kw: RecordingBridge(engines))
    cfg = compose_config(["rollout.n=2", "rollout.mode=colocated", "rollout.weight_sync_bucket_mb=1",
                          "rollout.weight_sync_check=false", "rollout.max_restarts=1", "data.max_response_length=4"])
    bundle = type("Bundle", (), {"chunks": [], "spec": None})()
    return rollout_mod.RolloutWorker(cfg, str(tmp_path), bundle, tok), manager


class Reward:
    def score(self, texts, sources, truths, extra_infos=None, prompts=None):
        return [1.0] * len(texts), {"reward/num_fallbacks": 0.0}


def batch(n):
    return {"input_ids_list": [[1, 2, 3]] * n, "data_source": ["x"] * n, "ground_truth": ["1"] * n,
            "extra_info": [{}] * n, "raw_prompt": ["p"] * n}


def test_step_then_validation_generates_on_resident_engines(worker):
    w, manager = worker
    # step 1: nothing was released before the first generation (a resume there must not reach SGLang)
    with w.serving():
        samples, scores, metrics = w.generate(batch(2), w.train_sampling, Reward())
    assert len(samples) == 4 and scores == [1.0] * 4 and metrics["rollout/num_restarts"] == 0.0
    assert manager.released == {"kv_cache", "weights"}  # the trainer has the devices while it trains
    w.sync_weights()
    assert manager.released == set()
    # validation right after the step: resident engines (the old order released them after the sync)
    _, val_scores, _ = w.generate(batch(3), w.val_sampling, Reward())
    assert len(val_scores) == 3
    assert manager.log == ["resume:kv_cache,weights", "generate", "release", "resume:weights", "sync",
                           "resume:kv_cache", "generate"]


def test_resume_from_checkpoint_syncs_into_resident_engines(worker):
    w, manager = worker
    w.sync_weights()  # BaseTrainer's resume syncs before any generation
    assert manager.log == ["resume:weights", "sync", "resume:kv_cache"] and manager.released == set()


def test_critic_warmup_step_resyncs_before_the_next_generation(worker):
    """A critic-warm-up step updates no actor and syncs nothing, but the engines released their weights while
    the trainer computed: SGLang's memory saver resumes them as undefined memory.  The next generation (the
    next step's or a validation's) refills them first."""
    w, manager = worker
    with w.serving():  # step 1 (critic warm-up): generate, release, no actor update, no sync
        w.generate(batch(2), w.train_sampling, Reward())
    assert manager.released == {"kv_cache", "weights"} and w.weights_dropped
    with w.serving():  # step 2: weights back before generating
        w.generate(batch(2), w.train_sampling, Reward())
    assert manager.log == ["resume:kv_cache,weights", "generate", "release", "resume:weights", "sync",
                           "resume:kv_cache", "generate", "release"]


def test_validation_after_a_critic_warmup_step_generates_on_synced_engines(worker):
    """PPOTrainer.validate calls ensure_resident: after a warm-up step (engines released, no sync) validation
    generated on released engines and the run stopped at the first validation after it."""
    w, manager = worker
    with w.serving():
        w.generate(batch(2), w.train_sampling, Reward())
    w.ensure_resident()  # what validate() does first
    _, scores, _ = w.generate(batch(3), w.val_sampling, Reward())
    assert len(scores) == 3 and not w.weights_dropped
    assert manager.log[-4:] == ["resume:weights", "sync", "resume:kv_cache", "generate"]
    w.ensure_resident()  # resident and synced: no second sync (the manager's resume of nothing is a no-op)
    assert manager.log[-2:] == ["generate", "resume:kv_cache,weights"] and manager.released == set()


def test_ppo_validate_makes_the_engines_resident_first():
    import inspect

    from rlhf.trainer.ppo_trainer import PPOTrainer

    src = inspect.getsource(PPOTrainer.validate)
    assert src.index("self.rollout.ensure_resident()") < src.index("self.rollout.generate(")
