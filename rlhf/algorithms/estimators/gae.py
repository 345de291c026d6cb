"""GAE, the critic-based token-level advantage estimator (verl ``core_algos`` API).

Every estimator returns ``(advantages, returns)`` of shape (bs, response_length),
computed under ``torch.no_grad()``.  Both outputs are 0 wherever
``response_mask`` is 0, and values at masked positions of the inputs (NaN,
inf, anything) never influence the result.  Each accepts verl's ``config=``
(``AlgoConfig`` field names: ``gamma``, ``lam``) and an optional per-sample
``sample_mask`` (bs,): samples with 0 get advantage and return 0 and are left
out of the batch whitening.  A non-finite reward or value at a valid token
raises ValueError.  The other token-level estimators (REINFORCE++, ReMax) share these
conventions.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms._validation import check_same_shape
from rlhf.algorithms.config_access import resolve
from rlhf.algorithms.estimators._inputs import token_inputs
from rlhf.algorithms.masked_ops import masked_whiten
from rlhf.algorithms.registry import AdvantageEstimator, register_adv_est


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
    mask = token_inputs(token_level_rewards, response_mask, sample_mask, values=values)
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
