"""Group-relative outcome estimators, and the GRPO family: GRPO, Dr.GRPO (GRPO without the
std division), ``grpo_vectorized`` and pass@k GRPO.

Each reduces a response to one score ``R_i = sum_t mask_t * r_t`` and compares
it with the other responses to the same prompt (``index``: one prompt uid per
sample).  Shared behaviour:

* a group whose valid scores are all exactly equal gets advantage exactly 0
  (no rounding residue of ``R_i - mean``, which dividing by a ~1 ulp std would
  blow up to a same-signed +-0.7);
* ``sample_mask`` (bs,) excludes unscorable samples from the group statistics;
  they get advantage 0; a group with fewer than 2 valid samples gets 0;
* a group of total size 1 (``rollout.n = 1``) uses baseline 0, as verl does;
* a non-finite score at a valid sample raises ValueError;
* ``config=`` (verl AlgoConfig) and extra keyword arguments are accepted.

Returns are ``(advantages, returns)``, identical (bs, response_length) tensors, 0 at masked
positions.  These conventions hold for every group estimator (rloo, opo, gpg, reinforce.py's
REINFORCE++-baseline); the shared helpers are in _inputs.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms.config_access import resolve
from rlhf.algorithms.estimators._inputs import broadcast_over_response, centered_scores, grouped
from rlhf.algorithms.grouping import GroupIndex
from rlhf.algorithms.registry import AdvantageEstimator, register_adv_est


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: Optional[bool] = None,
    config: Any = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, sec. 4.1.2):

        A_i = (R_i - mean_g(R)) / (std_g(R) + epsilon)

    with the mean and *unbiased* std over the valid responses of prompt group g.
    With ``norm_adv_by_std_in_grpo=False`` the division is dropped (Dr.GRPO,
    Liu et al. 2025, arXiv:2503.20783, eq. 3).  A group of size 1 uses mean 0
    and std 1 (as verl), so its advantage is R_i / (1 + epsilon).

    Args:
        token_level_rewards: shape (bs, response_length); R_i is the masked sum.
        response_mask: same shape.
        index: (bs,) prompt uids (numpy array / list / tensor).
        epsilon: added to the std to avoid division by zero.
        norm_adv_by_std_in_grpo: divide by the group std; None reads
            ``config.norm_adv_by_std_in_grpo`` (default True).
        config: verl AlgoConfig-like object (optional).
        sample_mask: (bs,) 1 = valid sample (optional).

    Returns:
        (advantages, returns), identical tensors of shape (bs, response_length).

    Raises:
        ValueError: shape mismatch, ``len(index) != bs``, or a non-finite valid score.
    """
    norm = resolve(norm_adv_by_std_in_grpo, config, "norm_adv_by_std_in_grpo", True)
    with torch.no_grad():
        scores, valid, gid, total, stats = grouped(token_level_rewards, response_mask, index, sample_mask)
        centered = centered_scores(scores, valid, gid, total, stats)
        std = torch.where(total < 2, torch.ones_like(scores), stats.std[gid])
        scalars = centered / (std + epsilon) if norm else centered
        advantages = broadcast_over_response(scalars, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: Optional[bool] = None,
    config: Any = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``grpo_vectorized`` name; identical to :func:`compute_grpo_outcome_advantage`
    (which is already vectorised).  Same arguments, values and errors."""
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon,
                                          norm_adv_by_std_in_grpo, config, sample_mask)


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
