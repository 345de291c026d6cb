"""verl-compatible facade: ``from rlhf.algorithms.core_algos import ...`` works like
``verl.trainer.ppo.core_algos``.  The implementations live in small modules:
registry, advantages, group_advantages, group_variants, losses, policy_losses,
cov_losses, kl, masked_ops, dapo, config_access.

``ADV_ESTIMATOR_REGISTRY`` and ``POLICY_LOSS_REGISTRY`` are forwarded by
reference: reading them gives the live registries, and assigning them here
(``core_algos.ADV_ESTIMATOR_REGISTRY = {...}``) replaces the registry that
``register_adv_est`` / ``get_adv_estimator_fn`` use.
"""

from rlhf.algorithms import _forwarding
from rlhf.algorithms.advantages import (
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
)
from rlhf.algorithms.config_access import ConfigOverlay, config_get
from rlhf.algorithms.cov_losses import compute_policy_loss_clip_cov, compute_policy_loss_kl_cov
from rlhf.algorithms.dapo import compute_overlong_penalty, filter_groups_by_metric
from rlhf.algorithms.group_advantages import (
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
)
from rlhf.algorithms.group_variants import compute_gpg_outcome_advantage, compute_grpo_passk_outcome_advantage
from rlhf.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
    sequence_kl,
)
from rlhf.algorithms.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    global_batch_info,
)
from rlhf.algorithms.masked_ops import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf.algorithms.policy_losses import (
    compute_policy_loss_cispo,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
)
from rlhf.algorithms.registry import (
    AdvantageEstimator,
    PolicyLossFn,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)

__getattr__ = _forwarding.forwarded_getattr(__name__)
_forwarding.install(__name__)

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "ConfigOverlay",
    "FixedKLController",
    "LOSS_AGG_MODES",
    "PolicyLossFn",
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
