"""Structured schema of the training config (Hydra / OmegaConf): every key, its type and its default.

The YAML tree under `rlhf/config/` (base `ppo_trainer.yaml`, `algorithm/` presets, `recipe/` files) is
composed onto these dataclasses in struct mode, so OmegaConf itself rejects an unknown key, a value of
the wrong type and a value outside an Enum's members (``rollout.mode=hybrid``).  Ranges and rules
within one section are each dataclass's ``problems(at)`` method (run by ``__post_init__`` when the
dataclass is built, and on the composed config by :func:`field_problems`, which reports them all at
once); rules that span sections are in :mod:`rlhf.config.validate`.  Names follow verl's.

One module per group of sections: data.py (data, model, parallel), actor.py (actor, actor.policy_loss,
critic), rollout.py, algorithm.py, reward.py, trainer.py (trainer, global_profiler); rules.py holds the range helpers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf.config.schema.actor import ActorConfig, CriticConfig, PolicyLossConfig
from rlhf.config.schema.algorithm import AlgorithmConfig, DPOConfig, FilterGroupsConfig, KLControlConfig
from rlhf.config.schema.data import DataConfig, ModelConfig, ParallelConfig
from rlhf.config.schema.reward import (CustomRewardConfig, Gsm8kRewardConfig, OverlongBufferConfig, RewardConfig,
                                       RewardSourceConfig)
from rlhf.config.schema.rollout import RolloutConfig, RolloutValConfig
from rlhf.config.schema.rules import Checked
from rlhf.config.schema.trainer import GlobalProfilerConfig, TrainerConfig

__all__ = ["RLHFConfig", "field_problems", "Checked", "DataConfig", "ModelConfig", "ParallelConfig", "ActorConfig",
           "PolicyLossConfig", "CriticConfig", "RolloutConfig", "RolloutValConfig", "AlgorithmConfig",
           "KLControlConfig", "FilterGroupsConfig", "DPOConfig", "RewardConfig", "RewardSourceConfig",
           "CustomRewardConfig", "OverlongBufferConfig", "Gsm8kRewardConfig", "TrainerConfig",
           "GlobalProfilerConfig"]


@dataclass
class RLHFConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)


def field_problems(cfg: Any) -> list[str]:
    """Every single-field problem of a composed config (a DictConfig typed by :class:`RLHFConfig`): the
    ``problems`` of each section, run on the config's nodes, in schema order, keys in full."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    out: list[str] = []

    def walk(node: Any, at: str) -> None:
        check = getattr(OmegaConf.get_type(node), "problems", None)
        if check is not None:
            out.extend(check(node, at))
        for k in node.keys():
            child = node[k]
            if isinstance(child, DictConfig):
                walk(child, f"{at}{k}.")
            elif isinstance(child, ListConfig):
                for i, item in enumerate(child):
                    if isinstance(item, DictConfig):
                        walk(item, f"{at}{k}[{i}].")

    walk(cfg, "")
    return out
