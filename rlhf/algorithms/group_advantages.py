"""Group-relative outcome estimators: GRPO, RLOO, REINFORCE++-baseline, OPO.

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

Returns are ``(advantages, returns)``, identical (bs, response_length) tensors
(REINFORCE++-baseline excepted, see its docstring), 0 at masked positions.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms._estimator_inputs import broadcast_over_response, effective_mask, outcome_scores
from rlhf.algorithms._grouping import GroupIndex, GroupStats, group_ids, group_stats
from rlhf.algorithms.config_access import resolve
from rlhf.algorithms.masked_ops import masked_whiten
from rlhf.algorithms.registry import AdvantageEstimator, register_adv_est


def grouped(token_level_rewards, response_mask, index, sample_mask):
    """Scores, validity, dense group ids, total group sizes and :class:`GroupStats` over valid samples."""
    scores, valid = outcome_scores(token_level_rewards, response_mask, sample_mask)
    gid, n_groups = group_ids(index, scores.shape[0], scores.device)
    total = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add(
        0, gid, torch.ones_like(scores))
    return scores, valid, gid, total[gid], group_stats(scores, gid, n_groups, valid)


def centered_scores(scores, valid, gid, total, stats: GroupStats) -> torch.Tensor:
    """``R_i - mean_g`` with exact 0 for constant groups and invalid samples, ``R_i`` for groups of size 1."""
    centered = torch.where(stats.constant[gid], torch.zeros_like(scores), scores - stats.mean[gid])
    centered = torch.where(total < 2, scores, centered)
    return torch.where(valid, centered, torch.zeros_like(scores))


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


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: Any = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262, sec. 3.2):

        A_i = whiten_batch(R_i - mean_g(R))

    the group-mean baseline (0 for a group of size 1) broadcast over the valid
    tokens, then whitened globally with :func:`masked_whiten` over all valid
    tokens of the valid samples.  The group-centred score of a constant group
    is exactly 0; the batch whitening then shifts it by the batch mean like
    every other token (exactly 0 when the whole batch is constant).

    Args / Raises: as :func:`compute_grpo_outcome_advantage` (``epsilon`` and
    ``config`` unused), plus ValueError for fewer than 2 valid tokens.

    Returns:
        (advantages, returns), identical tensors of shape (bs, response_length).
    """
    with torch.no_grad():
        scores, valid, gid, total, stats = grouped(token_level_rewards, response_mask, index, sample_mask)
        centered = centered_scores(scores, valid, gid, total, stats)
        mask = effective_mask(response_mask, valid)
        advantages = masked_whiten(broadcast_over_response(centered, mask), mask)
    return advantages, advantages


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
