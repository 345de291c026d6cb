"""Structured schema of the training config (names follow verl's): every key, its type, default and checks.  The
YAML tree is composed onto these dataclasses in struct mode, so OmegaConf rejects an unknown key, a wrong type, a
value outside an Enum.  A field's range is declared beside its default (schema/rules.py), a section's rules across its
fields are its ``rules``; both run when a dataclass is built and on the composed config (:func:`field_problems`).
model.py: data, model, parallel, actor, critic; run.py: rollout, algorithm, reward, trainer, global_profiler;
distill.py: distill (on-policy distillation)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf.config.schema.model import (ActorConfig, CriticConfig, DataConfig, ModelConfig, ParallelConfig,
                                      PolicyLossConfig)
from rlhf.config.schema.distill import DistillConfig, TeacherConfig
from rlhf.config.schema.run import (AlgorithmConfig, CustomRewardConfig, DPOConfig, FilterGroupsConfig,
                                    GlobalProfilerConfig, Gsm8kRewardConfig, KLControlConfig, OverlongBufferConfig,
                                    RewardConfig, RewardSourceConfig, RolloutConfig, RolloutValConfig, TrainerConfig)

__all__ = ["RLHFConfig", "field_problems", "DataConfig", "ModelConfig", "ParallelConfig", "ActorConfig",
           "PolicyLossConfig", "CriticConfig", "RolloutConfig", "RolloutValConfig", "AlgorithmConfig",
           "KLControlConfig", "FilterGroupsConfig", "DPOConfig", "RewardConfig", "RewardSourceConfig",
           "CustomRewardConfig", "OverlongBufferConfig", "Gsm8kRewardConfig", "TrainerConfig", "GlobalProfilerConfig",
           "DistillConfig", "TeacherConfig"]


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
    distill: DistillConfig = field(default_factory=DistillConfig)


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
