"""Schema section ``algorithm``: advantage estimator, KL control, DAPO's dynamic sampling, DPO."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.config.choices import AlgorithmName, KLControlType, KLEstimator
from rlhf.config.schema.rules import Checked, check, ge

__all__ = ["KLControlConfig", "FilterGroupsConfig", "DPOConfig", "AlgorithmConfig"]


@dataclass
class KLControlConfig(Checked):
    """KL penalty in the reward (algorithm.use_kl_in_reward): kl_coef x KL(actor || reference) per token."""

    type: KLControlType = KLControlType.fixed
    kl_coef: float = ge(0, 0.001)
    # adaptive: target KL in nats per WHOLE response (the sum over its tokens, averaged over responses), as in
    # Ziegler et al. 2019 (arXiv:1909.08593) sec. 2.2; not per token.  kl_coef is multiplied by
    # 1 + clip(KL / target_kl - 1, -0.2, 0.2) x responses / horizon after each step.
    target_kl: float = 0.1
    horizon: int = 10000  # adaptive: responses over which the coefficient adapts

    def rules(self, at: str = "") -> list[str]:
        return [f"{at}{k}={getattr(self, k)!r} must be > 0 for {at}type=adaptive." for k in ("target_kl", "horizon")
                if self.type == KLControlType.adaptive and (getattr(self, k) is None or getattr(self, k) <= 0)]


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling (rlhf/dapo.py): drop prompt groups whose responses all got the same `metric`, generate
    more prompt batches until data.train_batch_size groups are kept."""
    enable: bool = False
    metric: str = "score"  # score (reward) | seq_reward (reward + overlong shaping)
    max_num_gen_batches: int = 10  # generation rounds per step at most (<= 0: no cap)


@dataclass
class DPOConfig:
    """algorithm.name=dpo (rlhf/dpo_trainer.py): offline preference pairs, sigmoid loss."""
    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge
    label_smoothing: float = 0.0


_UNIT = (lambda v: 0 <= v <= 1, "must be in [0, 1] (1.0 for outcome rewards)")


@dataclass
class AlgorithmConfig(Checked):
    name: AlgorithmName = AlgorithmName.ppo
    # a name in rlhf.algorithms' registry (checked by rlhf.config.validate); remax also generates one greedy
    # response per prompt as its baseline
    adv_estimator: str = "gae"
    gamma: float = check(1.0, *_UNIT)
    lam: float = check(1.0, *_UNIT)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLEstimator = KLEstimator.kl
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # true: responses cut at data.max_response_length (no EOS) are masked out of the policy and value losses
    overlong_filter: bool = False
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
