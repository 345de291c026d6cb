"""Advantage estimators and their name registry (verl ``core_algos`` API).

Every estimator returns ``(advantages, returns)`` of shape (bs, response_length)
and is computed under ``torch.no_grad()``.  Both outputs are 0 wherever
``response_mask`` is 0, and values at masked positions of the inputs (NaN,
inf, anything) never influence the result.

Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) reduce each response to
one scalar score ``sum_t mask_t * token_level_rewards_t`` and broadcast the
resulting advantage over the response's valid tokens.
"""

from enum import Enum
from typing import Callable, Union

import torch

from rlhf.algorithms._grouping import GroupIndex, group_count_mean_std, group_ids
from rlhf.algorithms._validation import check_2d, check_same_shape
from rlhf.algorithms.masked_ops import masked_sum, masked_whiten


class AdvantageEstimator(str, Enum):
    """Names accepted by :func:`get_adv_estimator_fn` (``algorithm.adv_estimator``)."""

    GAE = "gae"
    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"


ADV_ESTIMATOR_REGISTRY: dict[str, Callable] = {}


def _name_of(name_or_enum: Union[str, AdvantageEstimator]) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(name_or_enum: Union[str, AdvantageEstimator]) -> Callable:
    """Decorator registering an advantage estimator under a name.

    Raises:
        ValueError: the name is already registered to a different function.
    """

    def decorator(fn: Callable) -> Callable:
        name = _name_of(name_or_enum)
        if ADV_ESTIMATOR_REGISTRY.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered to {ADV_ESTIMATOR_REGISTRY[name]}")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: Union[str, AdvantageEstimator]) -> Callable:
    """Return the estimator registered under ``name_or_enum`` (str or AdvantageEstimator).

    Raises:
        ValueError: unknown name; the message lists the registered names.
    """
    name = _name_of(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


def _check_rewards_and_mask(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    check_2d("token_level_rewards", token_level_rewards)
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)


def _broadcast_over_response(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(bs,) scalar per response -> (bs, response_length), 0 at masked positions."""
    per_token = scores.unsqueeze(-1).expand(response_mask.shape)
    return torch.where(response_mask != 0, per_token, torch.zeros_like(per_token))


@register_adv_est(AdvantageEstimator.GAE)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16):

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t   (the value-function target)

    computed right to left.  Masked positions (padding after the response, or
    masked spans such as tool observations inside it) are skipped: V_{t+1} and
    A_{t+1} are the value / advantage of the next *valid* token, carried across
    masked positions (verl's multi-turn recursion), and 0 after the last valid
    token.  The advantages are then whitened with :func:`masked_whiten` over
    all valid tokens of the batch (one global mean / unbiased std, as in verl);
    the returns are not whitened.

    Args:
        token_level_rewards: rewards r_t, shape (bs, response_length).
        values: critic values V_t, same shape.
        response_mask: 1 for response tokens, same shape.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        (advantages, returns), each (bs, response_length), 0 at masked positions.

    Raises:
        ValueError: shape mismatch, non-2D input, or fewer than 2 valid tokens
            in the batch (whitening needs an unbiased variance).
    """
    _check_rewards_and_mask(token_level_rewards, response_mask)
    check_same_shape(token_level_rewards=token_level_rewards, values=values)
    with torch.no_grad():
        valid = response_mask != 0
        next_value = torch.zeros_like(values[:, 0])
        next_advantage = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            advantage_t = delta + gamma * lam * next_advantage
            next_value = torch.where(valid[:, t], values[:, t], next_value)
            next_advantage = torch.where(valid[:, t], advantage_t, next_advantage)
            advantages[:, t] = next_advantage
        returns = torch.where(valid, advantages + values, torch.zeros_like(values))
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_adv_est(AdvantageEstimator.GRPO)
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, sec. 4.1.2):

        A_i = (R_i - mean_g(R)) / (std_g(R) + epsilon)

    with the mean and *unbiased* std over the responses of the same prompt
    group g.  With ``norm_adv_by_std_in_grpo=False`` the division is dropped
    (Dr.GRPO, Liu et al. 2025, arXiv:2503.20783).  A group of size 1 uses
    mean 0 and std 1 (as verl does), so its advantage is R_i / (1 + epsilon).

    Args:
        token_level_rewards: shape (bs, response_length); R_i is the masked sum.
        response_mask: same shape.
        index: (bs,) prompt uids (numpy array / list / tensor).
        epsilon: added to the std to avoid division by zero.
        norm_adv_by_std_in_grpo: divide by the group std (GRPO) or not (Dr.GRPO).

    Returns:
        (advantages, returns), identical tensors of shape (bs, response_length).

    Raises:
        ValueError: shape mismatch or ``len(index) != bs``.
    """
    _check_rewards_and_mask(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)
        gid, n_groups = group_ids(index, scores.shape[0], scores.device)
        count, mean, std = group_count_mean_std(scores, gid, n_groups)
        singleton = count[gid] < 2
        mean = torch.where(singleton, torch.zeros_like(scores), mean[gid])
        std = torch.where(singleton, torch.ones_like(scores), std[gid])
        centered = scores - mean
        scalars = centered / (std + epsilon) if norm_adv_by_std_in_grpo else centered
        advantages = _broadcast_over_response(scalars, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO leave-one-out advantage (Kool et al. 2019; Ahmadian et al. 2024,
    arXiv:2402.14740, eq. 5):

        A_i = R_i - 1/(k-1) * sum_{j != i} R_j = k/(k-1) * (R_i - mean_g(R))

    for a group of k >= 2 responses; a group of size 1 keeps A_i = R_i (as verl).

    Args:
        token_level_rewards: shape (bs, response_length); R_i is the masked sum.
        response_mask: same shape.
        index: (bs,) prompt uids.
        epsilon: unused; kept for verl signature compatibility.

    Returns:
        (advantages, returns), identical tensors of shape (bs, response_length).

    Raises:
        ValueError: shape mismatch or ``len(index) != bs``.
    """
    _check_rewards_and_mask(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)
        gid, n_groups = group_ids(index, scores.shape[0], scores.device)
        count, mean, _ = group_count_mean_std(scores, gid, n_groups)
        k = count[gid]
        leave_one_out = k / (k - 1).clamp_min(1) * (scores - mean[gid])
        scalars = torch.where(k > 1, leave_one_out, scores)
        advantages = _broadcast_over_response(scalars, response_mask)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage (Hu 2025, arXiv:2501.03262, sec. 3):
    discounted return-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens,
    then global masked whitening of G over the batch.

    The recursion runs right to left over valid tokens only: a masked span in
    the middle of a response (e.g. a tool observation) neither adds reward nor
    discounts nor resets the running return, which is carried across it.

    Args:
        token_level_rewards: shape (bs, response_length).
        response_mask: same shape.
        gamma: discount factor.

    Returns:
        advantages: whitened returns, (bs, response_length), 0 at masked positions.
        returns: un-whitened G_t, same shape, 0 at masked positions.

    Raises:
        ValueError: shape mismatch, or fewer than 2 valid tokens in the batch.
    """
    _check_rewards_and_mask(token_level_rewards, response_mask)
    with torch.no_grad():
        valid = response_mask != 0
        running_return = torch.zeros_like(token_level_rewards[:, 0])
        returns = torch.zeros_like(token_level_rewards)
        for t in reversed(range(token_level_rewards.shape[1])):
            updated = token_level_rewards[:, t] + gamma * running_return
            running_return = torch.where(valid[:, t], updated, running_return)
            returns[:, t] = torch.where(valid[:, t], running_return, torch.zeros_like(running_return))
        advantages = masked_whiten(returns, response_mask)
    return advantages, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): subtract the prompt-group
    mean score (0 for a group of size 1), broadcast over valid tokens, then
    whiten globally with :func:`masked_whiten` over all valid tokens.

    Args:
        token_level_rewards: shape (bs, response_length); R_i is the masked sum.
        response_mask: same shape.
        index: (bs,) prompt uids.
        epsilon: unused; kept for verl signature compatibility.

    Returns:
        (advantages, returns), identical tensors of shape (bs, response_length).

    Raises:
        ValueError: shape mismatch, ``len(index) != bs``, or fewer than 2 valid tokens.
    """
    _check_rewards_and_mask(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = masked_sum(token_level_rewards, response_mask, axis=-1)
        gid, n_groups = group_ids(index, scores.shape[0], scores.device)
        count, mean, _ = group_count_mean_std(scores, gid, n_groups)
        baseline = torch.where(count[gid] > 1, mean[gid], torch.zeros_like(scores))
        advantages = masked_whiten(_broadcast_over_response(scores - baseline, response_mask), response_mask)
    return advantages, advantages
