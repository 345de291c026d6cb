"""Advantage estimators, one module per family; importing this package registers them all
under the names of :class:`rlhf.algorithms.registry.AdvantageEstimator`.

Every estimator returns ``(advantages, returns)`` of shape (bs, response_length), 0 at masked
positions, and takes verl's keyword call ``fn(token_level_rewards=, response_mask=, index=,
config=, ...)`` plus an optional ``sample_mask`` (bs,) of trustworthy rewards.

* gae: GAE (with a critic);
* reinforce: REINFORCE++ and REINFORCE++-baseline;
* remax: ReMax (greedy-response baseline);
* grpo: GRPO, Dr.GRPO (``norm_adv_by_std_in_grpo=False``), ``grpo_vectorized``, pass@k GRPO;
* rloo: RLOO and ``rloo_vectorized``;
* opo: OPO (length-weighted optimal baseline);
* gpg: GPG.
"""

from rlhf.algorithms.estimators.gae import compute_gae_advantage_return
from rlhf.algorithms.estimators.gpg import compute_gpg_outcome_advantage
from rlhf.algorithms.estimators.grpo import (
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
)
from rlhf.algorithms.estimators.opo import compute_opo_outcome_advantage
from rlhf.algorithms.estimators.reinforce import (
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
)
from rlhf.algorithms.estimators.remax import compute_remax_outcome_advantage
from rlhf.algorithms.estimators.rloo import compute_rloo_outcome_advantage, compute_rloo_vectorized_outcome_advantage

__all__ = ["compute_gae_advantage_return", "compute_gpg_outcome_advantage", "compute_grpo_outcome_advantage",
           "compute_grpo_passk_outcome_advantage", "compute_grpo_vectorized_outcome_advantage",
           "compute_opo_outcome_advantage", "compute_reinforce_plus_plus_baseline_outcome_advantage",
           "compute_reinforce_plus_plus_outcome_advantage", "compute_remax_outcome_advantage",
           "compute_rloo_outcome_advantage", "compute_rloo_vectorized_outcome_advantage"]
