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
