"""Hub models are fetched before the process group exists (rlhf.workers.build.fetch_hub_models, called first by
rlhf.trainer.run): before, rank 0 downloaded inside resolve_model_path while every other rank waited in
``dist.barrier()`` on the default group (NCCL on a GPU run, under its watchdog: a 15 GB model could outlast it)."""
from __future__ import annotations

import torch.distributed as dist

from rlhf.config import compose_config


def test_every_hub_model_of_the_config_is_fetched_before_any_process_group(monkeypatch, tmp_path):
    import huggingface_hub

    import rlhf.workers.build as build

    fetched = []

    def snapshot_download(repo, allow_patterns=None):
        fetched.append((repo, dist.is_initialized()))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    cfg = compose_config(["model.path=Qwen/Qwen2.5-0.5B-Instruct", "model.critic_path=OpenRLHF/rm-0.5b",
                          "model.tokenizer_path=Qwen/Qwen2.5-0.5B-Instruct"], recipe="quickstart")
    assert build.fetch_hub_models(cfg) == ["Qwen/Qwen2.5-0.5B-Instruct", "OpenRLHF/rm-0.5b"]
    assert fetched == [("Qwen/Qwen2.5-0.5B-Instruct", False), ("OpenRLHF/rm-0.5b", False)]  # no group, each once
    # a local directory or the tiny model is nothing to fetch; resolving a hub name reads the cache, no barrier
    assert build.fetch_hub_models(compose_config([], recipe="quickstart")) == []
    monkeypatch.setattr(build.dist, "barrier", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a barrier")))
    monkeypatch.setattr(build.dist, "get_rank", lambda: 1)
    assert build.resolve_model_path(cfg) == str(tmp_path)
