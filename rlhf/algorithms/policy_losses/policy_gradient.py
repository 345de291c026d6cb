"""Policy-gradient (REINFORCE-form) losses ``l_t = -w_t * A_t * log pi(y_t)``: GPG (w = 1) and
CISPO (w = the clipped, stop-gradient importance weight).  Calling convention, config fields and metrics: policy_losses/__init__.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms.aggregation import agg_loss
from rlhf.algorithms.masked_ops import masked_mean
from rlhf.algorithms.policy_losses._inputs import ZERO, agg_kwargs, apply_weights, as_metrics, clip_bounds, prepare
from rlhf.algorithms.policy_losses.ppo import LOG_RATIO_CLAMP
from rlhf.algorithms.registry import PolicyLossMode, register_policy_loss

Tensor = torch.Tensor


@register_policy_loss(PolicyLossMode.GPG)
def compute_policy_loss_gpg(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                            loss_agg_mode: str = "token-mean", config: Any = None,
                            rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """GPG policy gradient (Chu et al. 2025, arXiv:2504.02546): the plain REINFORCE objective,
    no ratio, no clip,

        l_t = -A_t * log pi(y_t)

    aggregated by ``loss_agg_mode`` (the paper's 1/sum|o_i| sum_i sum_t is "token-mean").
    Pair it with ``algorithm.adv_estimator=gpg``.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    pg_losses = apply_weights(-x.log_prob * x.advantages, rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config))
    return loss, as_metrics(ppo_kl=masked_mean(-x.log_ratio, x.valid))


@register_policy_loss(PolicyLossMode.CISPO)
def compute_policy_loss_cispo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                              loss_agg_mode: str = "token-mean", config: Any = None,
                              rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """CISPO, Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, sec. 3):
    clip the importance weight, not the update, and stop its gradient, so every token
    keeps a gradient:

        r_hat = clip(r, 1 - eps_low, 1 + eps_high)
        l_t   = -sg(r_hat_t) * A_t * log pi(y_t)

    aggregated by ``loss_agg_mode`` (the paper's 1/sum|o_i| sum_i sum_t is "token-mean").
    ``actor.clip_ratio_low/high`` are eps_low / eps_high (MiniMax: no lower bound in
    effect, i.e. a large eps_low, and eps_high tuned).  ``pg_clipfrac`` = fraction of
    valid tokens whose weight was clipped.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_bounds(config)
    ratio = torch.exp(torch.clamp(x.log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high).detach()
    pg_losses = apply_weights(-clipped_ratio * x.advantages * x.log_prob, rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config))
    clipfrac = masked_mean((ratio != clipped_ratio).to(ratio.dtype), x.valid)
    return loss, as_metrics(pg_clipfrac=clipfrac, ppo_kl=masked_mean(-x.log_ratio, x.valid), pg_clipfrac_lower=ZERO)
