"""PPO-family algorithm functions (pure torch), verl ``core_algos`` API.

Modules: masked_ops (masked reductions / whitening), kl (KL estimators and
controllers), losses (loss aggregation, policy / value / entropy losses),
advantages (GAE, GRPO, RLOO, REINFORCE++ and the estimator registry), dapo
(overlong penalty, dynamic-sampling filter), dpo (DPO / IPO / hinge loss).
"""

from rlhf.algorithms.core_algos import *  # noqa: F401,F403
from rlhf.algorithms.core_algos import __all__ as _core_all
from rlhf.algorithms.dpo import DPO_LOSS_TYPES, compute_dpo_loss

__all__ = [*_core_all, "DPO_LOSS_TYPES", "compute_dpo_loss"]
