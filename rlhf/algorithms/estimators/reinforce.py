"""REINFORCE++ (Hu 2025, arXiv:2501.03262): the discounted return-to-go whitened over the
batch, and its group-baseline variant REINFORCE++-baseline.  Conventions (masks, ``config=``,
``sample_mask``, non-finite rewards refused) as in gae.py and grpo.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms.config_access import resolve
from rlhf.algorithms.estimators._inputs import (
    broadcast_over_response,
    centered_scores,
    effective_mask,
    grouped,
    token_inputs,
)
from rlhf.algorithms.grouping import GroupIndex
from rlhf.algorithms.masked_ops import masked_whiten
from rlhf.algorithms.registry import AdvantageEstimator, register_adv_est


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    gamma: Optional[float] = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
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
        config: verl AlgoConfig-like object; ``gamma`` is read from it.  For the
            older call ``fn(rewards, mask, gamma)`` a number here is taken as gamma.
        gamma: discount factor (wins over ``config.gamma``).
        sample_mask: (bs,) 1 = valid sample (optional).

    Returns:
        advantages: whitened returns, (bs, response_length), 0 at masked positions.
        returns: un-whitened G_t, same shape, 0 at masked positions.

    Raises:
        ValueError: shape mismatch, gamma missing, a non-finite reward at a valid
            token, or fewer than 2 valid tokens in the batch.
    """
    if isinstance(config, (int, float)) and not isinstance(config, bool):
        config, gamma = None, (float(config) if gamma is None else gamma)
    gamma = resolve(gamma, config, "gamma")
    if gamma is None:
        raise ValueError("REINFORCE++ needs gamma: pass gamma= or config= with a gamma field")
    mask = token_inputs(token_level_rewards, response_mask, sample_mask)
    with torch.no_grad():
        valid = mask != 0
        running_return = torch.zeros_like(token_level_rewards[:, 0])
        returns = torch.zeros_like(token_level_rewards)
        for t in reversed(range(token_level_rewards.shape[1])):
            updated = token_level_rewards[:, t] + gamma * running_return
            running_return = torch.where(valid[:, t], updated, running_return)
            returns[:, t] = torch.where(valid[:, t], running_return, torch.zeros_like(running_return))
        advantages = masked_whiten(returns, mask)
    return advantages, returns


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
