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


def test_no_launch_before_the_process_group_of_a_multi_node_job(launched, tmp_path, monkeypatch):
    """A two-node torchrun job with trainer.nnodes left null: the launcher's LOCAL_WORLD_SIZE < WORLD_SIZE says
    several nodes, so the engines wait for the ranks' nodes (before: launched as if one node)."""
    from rlhf.launch_env import launched_on_one_node

    (tmp_path / "config.json").write_text("{}")
    cfg = compose_config([f"model.path={tmp_path}"], recipe="grpo_tiny_cpu")
    for var, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(var, value)
    assert not launched_on_one_node() and rollout_mod.RolloutWorker.launch(cfg) is None and launched == []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert launched_on_one_node() and rollout_mod.RolloutWorker.launch(cfg) == f"engines:{tmp_path}"
    assert launched_on_one_node({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NNODES": "1"})
    assert not launched_on_one_node({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NNODES": "2"})
    assert not launched_on_one_node({"RANK": "0", "WORLD_SIZE": "8"})  # the launcher does not say
    assert launched_on_one_node({})


def test_gpu_engines_placed_before_the_process_group_see_every_rank_on_this_node(tmp_path, monkeypatch):
    """start_rollout before the process group on a one-node GPU job, a second Ray node with GPUs: the trainer's 8
    ranks are on this node, the disaggregated engines go to the other one (before: ranks 1-7 'not a Ray node',
    PlacementError).  Ray and the engines are stand-ins; the placement functions are the real ones."""
    import ray
    import torch

    import rlhf.rollout as rollout_pkg
    import rlhf.rollout.ray_cluster as ray_cluster

    nodes = [{"NodeID": "here", "NodeName": "n0", "Alive": True, "Resources": {"GPU": 8}},
             {"NodeID": "other", "NodeName": "n1", "Alive": True, "Resources": {"GPU": 8}}]
    made = {}

    class Manager:
        def __init__(self, n, engine_config, **kw):
            made.update(kw, n=n)

        def launch(self):
            made["launched"] = True

    class Context:
        def get_node_id(self):
            return "here"

    monkeypatch.setattr(ray_cluster, "init_ray", lambda: None)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    monkeypatch.setattr(rollout_pkg, "RolloutManager", Manager)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    import parallel.distributed as pd

    monkeypatch.setattr(pd, "compute_device", lambda: torch.device("cuda", 0))
    for var, value in {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(var, value)
    assert not dist.is_initialized()
    cfg = compose_config(["rollout.mode=disaggregated", "rollout.num_engines=2", "trainer.n_gpus_per_node=8",
                          "trainer.nnodes=2"], recipe="grpo_tiny_cpu")
    rollout_mod.start_rollout(cfg, str(tmp_path))
    assert made["launched"] and made["n"] == 2 and made["node_ids"] == ["here", "other"]
