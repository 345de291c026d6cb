"""Trainers: ``run(cfg)`` is what ``python -m rlhf.main`` (and ``rlhf.Trainer``) calls on every rank.

    rlhf.trainer.base:             BaseTrainer.fit() -- dist init, resume, validation cadence,
                                   checkpoints, HF export, close
    rlhf.trainer.ppo_trainer:      PPOTrainer (train_step: generate -> ... -> weight sync), validate
    rlhf.trainer.dpo_trainer:      DPOTrainer (algorithm.name=dpo)
    rlhf.trainer.dynamic_sampling: DAPO dynamic sampling and overlong reward shaping
    rlhf.trainer.metrics:          step metrics (verl's names), timers
    rlhf.trainer.checkpoint:       atomic, resumable checkpoints (layout in its docstring)
    rlhf.trainer.tracking:         TensorBoard / console metrics on rank 0
"""
from __future__ import annotations

__all__ = ["run"]


def run(cfg) -> dict:
    """Train with `cfg` (the composed Hydra config, see rlhf/config/); returns the last metrics.
    PPO and its variants (rlhf.trainer.ppo_trainer), or DPO on offline preference pairs when
    ``algorithm.name=dpo`` (rlhf.trainer.dpo_trainer).  Collective: every trainer rank calls it."""
    from rlhf.rollout.engine_args import share_nccl_env
    from rlhf.workers.build import fetch_hub_models

    share_nccl_env()  # before any NCCL communicator or engine: one NCCL_CUMEM_ENABLE for the trainer and engines
    fetch_hub_models(cfg)  # before the process group: no rank waits in a collective while another downloads
    if cfg.algorithm.name == "dpo":
        from .dpo_trainer import DPOTrainer

        return DPOTrainer(cfg).fit()
    from rlhf.workers.rollout import RolloutWorker

    engines = RolloutWorker.launch(cfg)  # CPU / own GPUs: the engines start while the trainer imports and builds
    from .ppo_trainer import PPOTrainer

    return PPOTrainer(cfg, engines=engines).fit()
