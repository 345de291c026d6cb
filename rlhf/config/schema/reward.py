"""Schema section ``reward``: the weighted reward sources (rlhf/rewards/sources.py) and their options."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlhf.config.choices import Gsm8kMethod
from rlhf.config.schema.rules import Checked, check, ge

__all__ = ["CustomRewardConfig", "OverlongBufferConfig", "RewardSourceConfig", "Gsm8kRewardConfig",
           "RewardFallbackConfig", "RewardConfig"]


@dataclass
class CustomRewardConfig:
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment: the last `len` tokens before data.max_response_length cost up to
    `penalty_factor` (rlhf.algorithms.compute_overlong_penalty)."""
    enable: bool = False
    len: Optional[int] = None  # None: data.max_response_length // 4
    penalty_factor: float = 1.0


@dataclass
class RewardSourceConfig:
    """One entry of reward.sources (rlhf/rewards/sources.py); the score is sum(weight x source)."""
    type: str = "rule"  # rule (registry by data_source) | model (HF sequence classifier) | custom (.py)
    weight: float = 1.0
    # model: HF dir / hub name / tiny://...; custom: python file, or object://reward/<id> (an in-process callable
    # given to rlhf.Trainer, rlhf.config.objects)
    path: Optional[str] = None
    name: str = "compute_score"  # custom: function name
    placement: str = "ray"  # model: ray (its own Ray worker) | local (in-process on rank 0); on the CPU either way
    num_gpus: float = 0.0  # model, placement=ray: GPUs of the worker; > 0 is refused (not placed nor planned)
    micro_batch_size: int = 16  # model: sequences per forward
    max_length: int = 2048  # model: prompt + response tokens (truncated from the left)
    # model, placement=ray: seconds to wait for the worker to load the model before the first batch (the run
    # stops with an error naming this key past it; null: no limit)
    start_timeout_s: Optional[float] = 600.0


@dataclass
class Gsm8kRewardConfig(Checked):
    """The GSM8K rule reward (data_source openai/gsm8k)."""
    method: Gsm8kMethod = Gsm8kMethod.strict
    format_score: float = 0.0  # score of a response with an answer in the expected format that is wrong


@dataclass
class RewardFallbackConfig(Checked):
    """What a sample gets from a source that failed on it (rlhf/rewards/fallback.py): rule = the data source's
    rule reward (else static); static = fallback_score + keyword_score x [any keyword in the response]
    - length_penalty x characters past max_chars; constant = fallback_score."""
    type: str = check("rule", lambda v: v in ("rule", "static", "constant"), "must be rule (the data source's rule "
                      "reward), static or constant")
    keywords: list[str] = field(default_factory=list)
    keyword_score: float = 0.0
    length_penalty: float = ge(0, 0.0)  # per character past max_chars
    max_chars: Optional[int] = check(None, lambda v: v >= 0, "must be >= 0", null=True)  # null: no length penalty


@dataclass
class RewardConfig(Checked):
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    # a rule/custom source gets timeout_s per sample, a model source per micro batch; slower is a fallback
    timeout_s: Optional[float] = check(3.0, lambda v: v > 0, "must be > 0, or null for no timeout", null=True)
    fallback_score: float = 0.0
    fallback: RewardFallbackConfig = field(default_factory=RewardFallbackConfig)
    # true: a sample no source (and no rule fallback) could score is left out of its group's baseline and of the
    # loss (counted in reward/num_unscorable); false: it counts with its fallback score
    exclude_unscorable: bool = True
    # empty: the rule reward of each data_source (or custom_reward_function when set)
    sources: list[RewardSourceConfig] = field(default_factory=list)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    gsm8k: Gsm8kRewardConfig = field(default_factory=Gsm8kRewardConfig)

    def rules(self, at: str = "") -> list[str]:
        return [f"{at}sources[{i}].num_gpus={s.num_gpus!r}: a reward model on GPUs is neither placed nor in the memory "
                f"plan (trainer ranks and rollout engines claim no Ray GPUs, so Ray would give the worker a GPU they "
                f"use); set num_gpus=0 (the model runs on the CPU), or serve it on GPUs outside this job and score with "
                f"a custom source (type=custom) that calls it." for i, s in enumerate(self.sources or [])
                if s.type == "model" and s.num_gpus and s.num_gpus > 0]
