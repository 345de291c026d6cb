"""verl-compatible facade: ``from rlhf.algorithms.core_algos import ...`` works
like ``verl.trainer.ppo.core_algos``.  The implementations live in small
modules: masked_ops, kl, losses, advantages, dapo.
"""

from rlhf.algorithms.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)
from rlhf.algorithms.dapo import compute_overlong_penalty, filter_groups_by_metric
from rlhf.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from rlhf.algorithms.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
)
from rlhf.algorithms.masked_ops import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "LOSS_AGG_MODES",
    "agg_loss",
    "apply_kl_penalty",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_overlong_penalty",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "filter_groups_by_metric",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
]
