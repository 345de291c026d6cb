"""The trainer's side of the rollout: SGLang engines (a RolloutManager on global rank 0), the weight
bridge that streams the actor into them, and the rank-0 generate-and-score whose result every rank
receives.  Moved as is from rlhf/setup.py and rlhf/trainer.py; the interface the trainers use:

    rollout = RolloutWorker(cfg, model_path, actor_bundle, tokenizer)   # collective
    rollout.train_sampling / rollout.val_sampling            # SamplingConfig of rollout.* / rollout.val_kwargs.*
    with rollout.serving(): ...                              # engines hold their GPU memory inside (colocated, GPU)
    samples, scores, reward_metrics = rollout.generate(batch, sampling, reward, seed=None)   # collective
    rollout.sync_weights()                                   # collective
    rollout.close()
"""
from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["RolloutWorker", "RolloutSink", "start_rollout"]


class RolloutSink:
    """Presents a RolloutManager (several engines) as one weight-bridge sink: every call goes to all
    engines; `expected_weights` is the first engine's (all engines serve the same model)."""

    def __init__(self, manager):
        self.manager = manager

    def expected_weights(self):
        import ray

        return ray.get(self.manager.actors[0].expected_weights.remote())

    def begin_weight_update(self):
        return self.manager.begin_weight_update()

    def update_weights_from_tensor(self, named_tensors):
        return self.manager.update_weights_from_tensor(named_tensors)

    def end_weight_update(self):
        return self.manager.end_weight_update()

    def flush_cache(self):
        import ray

        if hasattr(self.manager, "flush_cache"):
            return self.manager.flush_cache()
        return ray.get([a.flush_cache.remote() for a in self.manager.actors])

    def get_weights_by_name(self, name, truncate_size=100):
        import ray

        return ray.get(self.manager.actors[0].get_weights_by_name.remote(name, truncate_size))

    def init_weights_update_group(self, *args, **kwargs):
        return self.manager.init_weights_update_group_async(*args, **kwargs)

    def update_weights_from_distributed_async(self, *args, **kwargs):
        return self.manager.update_weights_from_distributed_async(*args, **kwargs)


def start_rollout(cfg, model_path: str):
    """Ray (the cluster at RAY_ADDRESS, else a local one) and a RolloutManager of ``rollout.num_engines``
    SGLang engines serving `model_path`."""
    import ray

    from rlhf.rollout import RolloutManager

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        else:
            ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    engine_kwargs = dict(model_path=model_path, tp_size=cfg.rollout.tensor_model_parallel_size, dtype=cfg.rollout.dtype,
                         mem_fraction_static=cfg.rollout.mem_fraction_static if torch.cuda.is_available() else None,
                         context_length=cfg.data.max_prompt_length + cfg.data.max_response_length + 8,
                         random_seed=cfg.trainer.seed)
    return RolloutManager(cfg.rollout.num_engines, engine_kwargs, placement=cfg.rollout.mode,
                          max_restarts=cfg.rollout.max_restarts, retain_latest_weights=not torch.cuda.is_available())


class RolloutWorker:
    """Collective: engines started on global rank 0 (``manager``; None elsewhere) and the weight bridge
    from `actor_bundle` (rlhf.mcore.models.ModelBundle) into them on every rank; `tokenizer` decodes
    the responses for the reward."""

    def __init__(self, cfg, model_path: str, actor_bundle, tokenizer):
        from rlhf.mcore.weight_sync import WeightBridge
        from rlhf.rollout import SamplingConfig
        from rlhf.rollout.sampling import stop_token_ids_for

        self.cfg, self.tokenizer = cfg, tokenizer
        rank0 = dist.get_rank() == 0
        stop_ids = stop_token_ids_for(model_path)
        r = cfg.rollout
        self.train_sampling = SamplingConfig(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                             max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_ids)
        v = r.val_kwargs
        self.val_sampling = SamplingConfig(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                                           max_new_tokens=cfg.data.max_response_length, stop_token_ids=stop_ids)
        self.manager = start_rollout(cfg, model_path) if rank0 else None
        dist.barrier()
        sinks = [RolloutSink(self.manager)] if rank0 else None
        self.bridge = WeightBridge(actor_bundle.chunks, actor_bundle.spec, sinks,
                                   transport="tensor" if r.mode == "colocated" else "distributed",
                                   bucket_bytes=r.weight_sync_bucket_mb << 20,
                                   check="sample" if r.weight_sync_check else None)

    def release(self) -> None:
        """Colocated on GPU: free the engines' memory while the trainer computes."""
        if dist.get_rank() == 0 and self.cfg.rollout.mode == "colocated" and torch.cuda.is_available():
            self.manager.release_memory_occupation()

    def resume(self) -> None:
        """Colocated on GPU: give the engines their memory back."""
        if dist.get_rank() == 0 and self.cfg.rollout.mode == "colocated" and torch.cuda.is_available():
            self.manager.resume_memory_occupation()

    @contextmanager
    def serving(self):
        """Engines hold their memory inside the block (resume ... release)."""
        self.resume()
        yield
        self.release()

    def generate(self, batch: dict, sampling, reward, seed: int | None = None) -> tuple[list, list, dict]:
        """Collective. Rank 0 generates for the prompts of `batch` (the trainer's collate: input_ids_list,
        data_source, ground_truth, extra_info, raw_prompt) with `sampling` (its seed replaced by `seed`
        when given) and scores the decoded responses with `reward` (rlhf.rewards.RewardManager; only rank
        0's is used); every rank receives (samples, scores, reward metrics incl. reward/num_fallbacks)."""
        payload = [None]
        if dist.get_rank() == 0:
            if seed is not None:
                sampling = dataclasses.replace(sampling, seed=seed)
            samples = self.manager.generate(batch["input_ids_list"], sampling)
            texts = self.tokenizer.batch_decode([x.response_ids for x in samples], skip_special_tokens=True)
            idx = [x.prompt_index for x in samples]
            scores, reward_metrics = reward.score(texts, [batch["data_source"][i] for i in idx],
                                                  [batch["ground_truth"][i] for i in idx],
                                                  extra_infos=[batch["extra_info"][i] for i in idx],
                                                  prompts=[batch["raw_prompt"][i] for i in idx])
            payload = [(samples, scores, reward_metrics)]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def sync_weights(self):
        """Collective. Stream the actor's weights into every engine; returns the bridge's stats."""
        self.resume()
        stats = self.bridge.sync()
        self.release()
        return stats

    def close(self) -> None:
        """Close the weight bridge and shut the engines down."""
        if self.bridge is not None:
            self.bridge.close()
        if self.manager is not None:
            self.manager.shutdown()
