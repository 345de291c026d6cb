"""Structured schema of the training config (names follow verl's): every key, its type, default and checks.  The
YAML tree is composed onto these dataclasses in struct mode, so OmegaConf rejects an unknown key, a wrong type, a
value outside an Enum; each field's range and a section's rules across its fields are the table schema/rules.yaml, a
section's code rules its ``rules`` (schema/rules.py: both run when a dataclass is built and on the composed config,
:func:`field_problems`).
model.py: data, model, parallel, actor, critic; run.py: rollout, algorithm, reward, trainer, global_profiler;
distill.py: distill (on-policy distillation)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.config.schema.distill import DistillConfig
from rlhf.config.schema.model import ActorConfig, CriticConfig, DataConfig, ModelConfig, ParallelConfig
from rlhf.config.schema.rules import field_problems
from rlhf.config.schema.run import (AlgorithmConfig, AsyncTrainingConfig, GlobalProfilerConfig, RewardConfig,
                                    RewardSourceConfig, RolloutConfig, TrainerConfig)

__all__ = ["RLHFConfig", "field_problems", "RolloutConfig", "RewardConfig", "RewardSourceConfig", "TrainerConfig"]


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
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)  # verl's, top level
