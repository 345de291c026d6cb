"""GPG, Group Policy Gradient: the group-centred score scaled up for the groups that carry a
gradient.  Group conventions as in grpo.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms.estimators._inputs import broadcast_over_response, centered_scores, grouped
from rlhf.algorithms.grouping import GroupIndex
from rlhf.algorithms.registry import AdvantageEstimator, register_adv_est


@register_adv_est(AdvantageEstimator.GPG)
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: Optional[float] = None,
    config: Any = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG, Group Policy Gradient (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement
    Learning Baseline for Model Reasoning", arXiv:2504.02546, corrected advantage):

        A_i = alpha * (R_i - mean_g(R)) / F_norm,    alpha = B / (B - M)

    B is the number of valid samples in the batch and M the number of those in
    groups whose rewards are all equal (they carry no gradient, so the others
    are scaled up to keep the batch gradient's magnitude: "accurate gradient
    estimation").  alpha = 1 when every sample is in such a group.  A group of
    size 1 uses mean 0 (as verl) and does not count in M.  (verl computes M
    from the raw scores, ``B / count_nonzero(R)``, which for 0/1 rewards counts
    the correct answers instead; we follow the paper.)

    Args:
        token_level_rewards: shape (bs, response_length); R_i is the masked sum.
        response_mask: same shape.
        index: (bs,) prompt uids.
        epsilon: unused (verl signature).
        f_norm: F_norm > 0 (1 in the paper's main setting).
        alpha: fixed alpha instead of B / (B - M) (optional).
        config: unused (verl signature).
        sample_mask: (bs,) 1 = valid sample (optional).

    Returns:
        (advantages, returns), identical tensors of shape (bs, response_length).

    Raises:
        ValueError: shape mismatch, ``len(index) != bs``, non-finite valid score, f_norm <= 0.
    """
    if not f_norm > 0:
        raise ValueError(f"f_norm must be > 0, got {f_norm}")
    with torch.no_grad():
        scores, valid, gid, total, stats = grouped(token_level_rewards, response_mask, index, sample_mask)
        centered = centered_scores(scores, valid, gid, total, stats)
        if alpha is None:
            n_valid = valid.sum()
            n_degenerate = (valid & stats.constant[gid] & (total >= 2)).sum()
            alpha = n_valid.to(scores.dtype) / (n_valid - n_degenerate).clamp_min(1).to(scores.dtype)
            alpha = torch.where(n_valid == n_degenerate, torch.ones_like(alpha), alpha)
        advantages = broadcast_over_response(alpha * centered / f_norm, response_mask)
    return advantages, advantages
