"""Token-level advantage estimators: GAE, REINFORCE++, ReMax (verl ``core_algos`` API).

Every estimator returns ``(advantages, returns)`` of shape (bs, response_length),
computed under ``torch.no_grad()``.  Both outputs are 0 wherever
``response_mask`` is 0, and values at masked positions of the inputs (NaN,
inf, anything) never influence the result.  Each accepts verl's ``config=``
(``AlgoConfig`` field names: ``gamma``, ``lam``) and an optional per-sample
``sample_mask`` (bs,): samples with 0 get advantage and return 0 and are left
out of the batch whitening.  A non-finite reward or value at a valid token
raises ValueError.  The group-relative estimators are in group_advantages.py
and group_variants.py; the name registry in registry.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms import registry
from rlhf.algorithms._estimator_inputs import (
    check_rewards_and_mask,
    effective_mask,
    refuse_non_finite,
    sample_validity,
)
from rlhf.algorithms._validation import check_1d, check_same_shape
from rlhf.algorithms.config_access import resolve
from rlhf.algorithms.masked_ops import masked_whiten
from rlhf.algorithms.registry import AdvantageEstimator, register_adv_est


def __getattr__(name: str) -> Any:
    """Registry names resolve to the live objects in registry.py (they may be replaced)."""
    if name in ("ADV_ESTIMATOR_REGISTRY", "POLICY_LOSS_REGISTRY"):
        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _token_inputs(token_level_rewards, response_mask, sample_mask, **more: torch.Tensor):
    """Validate, apply ``sample_mask`` to the mask and refuse non-finite valid entries."""
    check_rewards_and_mask(token_level_rewards, response_mask)
    valid = sample_validity(sample_mask, token_level_rewards.shape[0], token_level_rewards.device)
    mask = effective_mask(response_mask, valid)
    for name, tensor in {"token_level_rewards": token_level_rewards, **more}.items():
        refuse_non_finite(name, tensor, mask != 0)
    return mask


@register_adv_est(AdvantageEstimator.GAE)
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: Optional[float] = None,
    lam: Optional[float] = None,
    config: Any = None,
    sample_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
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
        gamma, lam: discount and GAE lambda; None reads ``config.gamma`` / ``config.lam``.
        config: verl AlgoConfig-like object (optional).
        sample_mask: (bs,) 1 = valid sample (optional).

    Returns:
        (advantages, returns), each (bs, response_length), 0 at masked positions.

    Raises:
        ValueError: shape mismatch, non-2D input, gamma/lam missing, a non-finite
            reward or value at a valid token, or fewer than 2 valid tokens.
    """
    gamma, lam = resolve(gamma, config, "gamma"), resolve(lam, config, "lam")
    if gamma is None or lam is None:
        raise ValueError(f"GAE needs gamma and lam (got gamma={gamma}, lam={lam}); pass them or config=")
    check_same_shape(token_level_rewards=token_level_rewards, values=values)
    mask = _token_inputs(token_level_rewards, response_mask, sample_mask, values=values)
    with torch.no_grad():
        valid = mask != 0
        rewards = torch.where(valid, token_level_rewards, torch.zeros_like(token_level_rewards))
        values = torch.where(valid, values, torch.zeros_like(values))
        next_value = torch.zeros_like(values[:, 0])
        next_advantage = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            advantage_t = delta + gamma * lam * next_advantage
            next_value = torch.where(valid[:, t], values[:, t], next_value)
            next_advantage = torch.where(valid[:, t], advantage_t, next_advantage)
            advantages[:, t] = next_advantage
        returns = torch.where(valid, advantages + values, torch.zeros_like(values))
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


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
    mask = _token_inputs(token_level_rewards, response_mask, sample_mask)
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
    mask = _token_inputs(token_level_rewards, response_mask, sample_mask)
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
