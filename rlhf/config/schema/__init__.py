"""Structured schema of the training config (verl's names): every key's type and default, composed in struct mode
(OmegaConf rejects an unknown key, a wrong type, a value outside an Enum); ranges and rules in rules.yaml and the
sections' ``rules`` (rules.py, :func:`field_problems`).  model.py: data, model, parallel, actor, critic; run.py:
rollout, algorithm, reward, trainer, global_profiler; distill.py: distill (on-policy distillation)."""
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
