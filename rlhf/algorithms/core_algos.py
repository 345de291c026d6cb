"""verl-compatible facade: ``from rlhf.algorithms.core_algos import ...`` works like
``verl.trainer.ppo.core_algos``.  It only re-exports; the implementations live by idea in
registry, estimators/, policy_losses/, aggregation, masked_ops, kl, value_loss, entropy,
dapo and config_access (see rlhf/algorithms/__init__.py).

``ADV_ESTIMATOR_REGISTRY`` and ``POLICY_LOSS_REGISTRY`` are registry.py's dicts (importing this
module registers the built-ins in them), so this module, ``rlhf.algorithms`` and registry.py show
the same dicts; see registry.py.
"""

from rlhf.algorithms.aggregation import agg_loss, global_batch_info
from rlhf.algorithms.config_access import ConfigOverlay, config_get
from rlhf.algorithms.dapo import compute_overlong_penalty, filter_groups_by_metric
from rlhf.algorithms.entropy import compute_entropy_loss, entropy_from_logits
from rlhf.algorithms.estimators import (
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from rlhf.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
    sequence_kl,
)
from rlhf.algorithms.masked_ops import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf.algorithms.policy_losses import (
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
    compute_policy_loss_bypass_mode,
    compute_policy_loss_reinforce,
)
from rlhf.algorithms.registry import (
    ADV_ESTIMATOR_REGISTRY,
    LOSS_AGG_MODES,
    POLICY_LOSS_REGISTRY,
    AdvantageEstimator,
    PolicyLossFn,
    PolicyLossMode,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)
from rlhf.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "ConfigOverlay",
    "FixedKLController",
    "LOSS_AGG_MODES",
    "PolicyLossFn",
    "PolicyLossMode",
    "agg_loss",
    "apply_kl_penalty",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_overlong_penalty",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_reinforce",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "config_get",
    "entropy_from_logits",
    "filter_groups_by_metric",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "global_batch_info",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
    "sequence_kl",
]
