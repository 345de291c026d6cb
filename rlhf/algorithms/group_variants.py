"""Group estimators with a twist on the GRPO baseline: GPG and pass@k GRPO.

Shared behaviour as in group_advantages.py: exact 0 for groups whose valid
scores are all equal, ``sample_mask`` excludes unscorable samples, a
non-finite valid score raises ValueError, verl's ``config=`` is accepted.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms._estimator_inputs import broadcast_over_response
from rlhf.algorithms._grouping import GroupIndex
from rlhf.algorithms.config_access import resolve
from rlhf.algorithms.group_advantages import centered_scores, grouped
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


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: Optional[bool] = None,
    config: Any = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO with k = group size (Tang et al. 2025, "Optimizing Language Models for
    Inference Time Objectives using Reinforcement Learning", arXiv:2503.19595): the
    objective is the best reward of the group, max_j R_j, and its leave-one-out
    policy-gradient advantage is

        A_i = max_j R_j - max_{j != i} R_j

    which is non-zero only for the (first) best response: A = R_max - R_second.
    With ``norm_adv_by_std_in_grpo`` it is divided by (std_g(R) + epsilon).  Ties
    for the best give 0 everywhere.  Needs rollout.n >= 2; a group left with
    fewer than 2 valid samples (``sample_mask``) gets 0.

    Args:
        token_level_rewards: shape (bs, response_length); R_i is the masked sum.
        response_mask: same shape.
        index: (bs,) prompt uids.
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: None reads ``config.norm_adv_by_std_in_grpo`` (default True).
        config: verl AlgoConfig-like object (optional).
        sample_mask: (bs,) 1 = valid sample (optional).

    Returns:
        (advantages, returns), identical tensors of shape (bs, response_length).

    Raises:
        ValueError: a group with fewer than 2 samples (set rollout.n >= 2), shape
            mismatch, ``len(index) != bs``, or a non-finite valid score.
    """
    norm = resolve(norm_adv_by_std_in_grpo, config, "norm_adv_by_std_in_grpo", True)
    with torch.no_grad():
        scores, valid, gid, total, stats = grouped(token_level_rewards, response_mask, index, sample_mask)
        if bool((total < 2).any()):
            raise ValueError(f"grpo_passk needs at least 2 responses per prompt (rollout.n >= 2); got a group of "
                             f"{int(total.min())}")
        n_groups, position = stats.count.shape[0], torch.arange(scores.shape[0], device=scores.device)
        neg_inf = torch.full_like(scores, -torch.inf)
        best = torch.full_like(stats.mean, -torch.inf).scatter_reduce(
            0, gid, torch.where(valid, scores, neg_inf), reduce="amax")
        is_best = valid & (scores == best[gid])
        first = torch.full((n_groups,), scores.shape[0], device=scores.device).scatter_reduce(
            0, gid, torch.where(is_best, position, torch.full_like(position, scores.shape[0])), reduce="amin")
        is_top = position == first[gid]
        second = torch.full_like(stats.mean, -torch.inf).scatter_reduce(
            0, gid, torch.where(valid & ~is_top, scores, neg_inf), reduce="amax")
        gap = torch.where(is_top & (stats.count[gid] >= 2), best[gid] - second[gid], torch.zeros_like(scores))
        scalars = gap / (stats.std[gid] + epsilon) if norm else gap
        advantages = broadcast_over_response(scalars, response_mask)
    return advantages, advantages
