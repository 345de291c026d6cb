"""Structured schema of the training config: every key, its type, its default and its checks.

The YAML tree (``rlhf/config/ppo_trainer.yaml``, the presets, the recipes, the command line) is composed onto these
dataclasses in struct mode, so OmegaConf itself rejects an unknown key, a value of the wrong type and a value outside
an Enum's members (``rollout.mode=hybrid``).  A field's range is declared beside its default
(:mod:`rlhf.config.schema.rules`), a section's rules across its fields are its ``rules`` method; both run when a
dataclass is built and on the composed config (:func:`field_problems`); rules across sections are
:mod:`rlhf.config.validate`'s.  Names follow verl's.  model.py: data, model, parallel, actor, critic; run.py:
rollout, algorithm, reward, trainer, global_profiler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf.config.schema.model import (ActorConfig, CriticConfig, DataConfig, ModelConfig, ParallelConfig,
                                      PolicyLossConfig)
from rlhf.config.schema.run import (AlgorithmConfig, CustomRewardConfig, DPOConfig, FilterGroupsConfig,
                                    GlobalProfilerConfig, Gsm8kRewardConfig, KLControlConfig, OverlongBufferConfig,
                                    RewardConfig, RewardSourceConfig, RolloutConfig, RolloutValConfig, TrainerConfig)

__all__ = ["RLHFConfig", "field_problems", "DataConfig", "ModelConfig", "ParallelConfig", "ActorConfig",
           "PolicyLossConfig", "CriticConfig", "RolloutConfig", "RolloutValConfig", "AlgorithmConfig",
           "KLControlConfig", "FilterGroupsConfig", "DPOConfig", "RewardConfig", "RewardSourceConfig",
           "CustomRewardConfig", "OverlongBufferConfig", "Gsm8kRewardConfig", "TrainerConfig", "GlobalProfilerConfig"]


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
    """Every single-section problem of a composed config (a DictConfig typed by :class:`RLHFConfig`): each section's
    ``problems`` run on the config's nodes, in schema order, keys in full."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    def walk(node: Any, at: str) -> list[str]:
        check = getattr(OmegaConf.get_type(node), "problems", None)
        out = check(node, at) if check else []
        for k in node.keys():
            child = node[k]
            items = [(f"{at}{k}.", child)] if isinstance(child, DictConfig) else [
                (f"{at}{k}[{i}].", c) for i, c in enumerate(child) if isinstance(c, DictConfig)] \
                if isinstance(child, ListConfig) else []
            out += [p for sub, c in items for p in walk(c, sub)]
        return out

    return walk(cfg, "")
