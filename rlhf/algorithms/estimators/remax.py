"""ReMax: the sampled response's return minus the reward of the greedy response to the same
prompt (the trainer generates it: rlhf/trainer/remax.py).  Conventions as in gae.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms._validation import check_1d
from rlhf.algorithms.estimators._inputs import refuse_non_finite, token_inputs
from rlhf.algorithms.registry import AdvantageEstimator, register_adv_est


@register_adv_est(AdvantageEstimator.REMAX)
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement
    Learning Method for Aligning LLMs", arXiv:2310.10505, Algorithm 1 / eq. 6):

        G_t = sum_{t' >= t} mask_t' * r_t'      (undiscounted return-to-go)
        A_t = G_t - b,    b = r(x, greedy response)

    the baseline ``b`` being the reward of the greedy (argmax) response to the
    same prompt, which the trainer generates once per prompt.  For an outcome
    reward on the last token ``A_t = R - b`` on every token; a sample whose
    reward equals its baseline gets exactly 0.

    Args:
        token_level_rewards: shape (bs, response_length).
        reward_baselines: greedy-response reward per sample, shape (bs,).
        response_mask: same shape as the rewards.
        config: unused (verl signature).
        sample_mask: (bs,) 1 = valid sample (optional).

    Returns:
        (advantages, returns), each (bs, response_length), 0 at masked positions.

    Raises:
        ValueError: shape errors, or a non-finite reward / baseline at a valid sample.
    """
    check_1d("reward_baselines", reward_baselines)
    mask = token_inputs(token_level_rewards, response_mask, sample_mask)
    if reward_baselines.shape[0] != mask.shape[0]:
        raise ValueError(f"reward_baselines has {reward_baselines.shape[0]} entries but the batch has {mask.shape[0]}")
    refuse_non_finite("reward_baselines", reward_baselines, (mask != 0).any(dim=-1))
    with torch.no_grad():
        valid = mask != 0
        rewards = torch.where(valid, token_level_rewards, torch.zeros_like(token_level_rewards))
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
        advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1)
        zeros = torch.zeros_like(returns)
        return torch.where(valid, advantages, zeros), torch.where(valid, returns, zeros)
