"""OPO, the length-weighted optimal reward baseline.  Group conventions as in grpo.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms.estimators._inputs import broadcast_over_response, grouped
from rlhf.algorithms.grouping import GroupIndex
from rlhf.algorithms.registry import AdvantageEstimator, register_adv_est


@register_adv_est(AdvantageEstimator.OPO)
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Any = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO, length-weighted optimal baseline (Hao et al. 2025, "On-Policy RL with Optimal
    Reward Baseline", arXiv:2505.23585, the practical optimal baseline):

        b_g = sum_{i in g} l_i R_i / sum_{i in g} l_i,    A_i = R_i - b_g

    with l_i the number of valid tokens of response i (the optimal baseline
    for sequence-level rewards when gradient norms scale with length).  A group
    of size 1 uses b = 0 (as verl).

    Args / Raises: as :func:`compute_rloo_outcome_advantage`.

    Returns:
        (advantages, returns), identical tensors of shape (bs, response_length).
    """
    with torch.no_grad():
        scores, valid, gid, total, stats = grouped(token_level_rewards, response_mask, index, sample_mask)
        lengths = torch.where(valid, (response_mask != 0).sum(-1).to(scores.dtype), torch.zeros_like(scores))
        zeros = torch.zeros_like(stats.mean)
        weighted = zeros.index_add(0, gid, lengths * scores) / zeros.index_add(0, gid, lengths).clamp_min(1)
        scalars = torch.where(stats.constant[gid], torch.zeros_like(scores), scores - weighted[gid])
        scalars = torch.where(total < 2, scores, scalars)
        scalars = torch.where(valid, scalars, torch.zeros_like(scores))
        advantages = broadcast_over_response(scalars, response_mask)
    return advantages, advantages
