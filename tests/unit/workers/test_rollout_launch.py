"""When the rollout engines are launched: before the trainer's imports and model build where their memory does not
depend on the trainer's (CPU, disaggregated), from a model path found without collectives; otherwise later."""
import pytest
import torch.distributed as dist

import rlhf.workers.rollout as rollout_mod
from rlhf.config import compose_config
from rlhf.quickstart.resolve import local_model_path


@pytest.fixture
def launched(monkeypatch):
    calls = []
    monkeypatch.setattr(rollout_mod, "start_rollout", lambda cfg, path: calls.append(path) or f"engines:{path}")
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    return calls


def test_engines_launch_before_the_process_group_from_a_local_model(launched, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    cfg = compose_config([f"model.path={tmp_path}"], recipe="grpo_tiny_cpu")
    assert rollout_mod.RolloutWorker.launch(cfg) == f"engines:{tmp_path}" and launched == [str(tmp_path)]
    # a hub name is downloaded by the trainer (collective): launched after the process group exists
    assert rollout_mod.RolloutWorker.launch(compose_config(["model.path=Qwen/Qwen2-0.5B"],
                                                           recipe="grpo_tiny_cpu")) is None
    # several nodes: the ranks' nodes are known only after the process group gathered them
    assert rollout_mod.RolloutWorker.launch(compose_config([f"model.path={tmp_path}", "trainer.nnodes=2"],
                                                           recipe="grpo_tiny_cpu")) is None
    monkeypatch.setenv("RANK", "1"), monkeypatch.setenv("WORLD_SIZE", "2")  # not rank 0: never
    assert rollout_mod.RolloutWorker.launch(cfg) is None
    assert launched == [str(tmp_path)]


def test_colocated_gpu_engines_wait_for_the_models(launched, tmp_path, monkeypatch):
    import parallel.distributed as pd
    import torch

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(pd, "compute_device", lambda: torch.device("cuda", 0))
    cfg = compose_config([f"model.path={tmp_path}", "rollout.mode=colocated"], recipe="grpo_tiny_cpu")
    assert rollout_mod.RolloutWorker.launch(cfg) is None and launched == []
    cfg = compose_config([f"model.path={tmp_path}", "rollout.mode=disaggregated"], recipe="grpo_tiny_cpu")
    assert rollout_mod.RolloutWorker.launch(cfg) == f"engines:{tmp_path}"


def test_local_model_path_builds_nothing(tmp_path):
    cfg = compose_config([f"trainer.default_local_dir={tmp_path}"], recipe="grpo_tiny_cpu")
    assert str(cfg.model.path) == "tiny://quickstart"
    assert local_model_path(cfg) is None and not (tmp_path / "tiny_model").exists()  # not built yet: no launch
    assert local_model_path(cfg, "tiny://other") is None and local_model_path(cfg, str(tmp_path / "nope")) is None
    assert local_model_path(cfg, str(tmp_path)) == str(tmp_path)


def test_no_launch_before_the_process_group_of_a_job_of_several_ranks(launched, tmp_path, monkeypatch):
    """Rank 0 of a 2-rank torchrun job (one node, trainer.nnodes null) waits for the process group (before: it
    launched Ray and the engines first, and aborted at exit); a one-process job launches early."""
    (tmp_path / "config.json").write_text("{}")
    cfg = compose_config([f"model.path={tmp_path}"], recipe="grpo_tiny_cpu")
    for var, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(var, value)
    assert rollout_mod.RolloutWorker.launch(cfg) is None and launched == []
    monkeypatch.setenv("WORLD_SIZE", "1"), monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert rollout_mod.RolloutWorker.launch(cfg) == f"engines:{tmp_path}"
