"""RLOO, the leave-one-out baseline (and verl's ``rloo_vectorized`` name).  Group conventions
as in grpo.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms.estimators._inputs import broadcast_over_response, centered_scores, grouped
from rlhf.algorithms.grouping import GroupIndex
from rlhf.algorithms.registry import AdvantageEstimator, register_adv_est


@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Any = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO leave-one-out advantage (Kool et al. 2019; Ahmadian et al. 2024,
    arXiv:2402.14740, eq. 5):

        A_i = R_i - 1/(k-1) * sum_{j != i} R_j = k/(k-1) * (R_i - mean_g(R))

    over the k >= 2 valid responses of group g; a group of size 1 keeps A_i = R_i (as verl).

    Args:
        token_level_rewards: shape (bs, response_length); R_i is the masked sum.
        response_mask: same shape.
        index: (bs,) prompt uids.
        epsilon: unused (verl signature).
        config: unused (verl signature).
        sample_mask: (bs,) 1 = valid sample (optional).

    Returns:
        (advantages, returns), identical tensors of shape (bs, response_length).

    Raises:
        ValueError: shape mismatch, ``len(index) != bs``, or a non-finite valid score.
    """
    with torch.no_grad():
        scores, valid, gid, total, stats = grouped(token_level_rewards, response_mask, index, sample_mask)
        centered = centered_scores(scores, valid, gid, total, stats)
        k = stats.count[gid]
        scalars = torch.where(total < 2, centered, k / (k - 1).clamp_min(1) * centered)
        advantages = broadcast_over_response(scalars, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED)
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Any = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``rloo_vectorized`` name; identical to :func:`compute_rloo_outcome_advantage`
    (already vectorised; a group of size 1 keeps A_i = R_i in both).  Same arguments and errors."""
    return compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon, config, sample_mask)
