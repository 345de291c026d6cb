"""Covariance-based entropy-preserving policy losses: Clip-Cov and KL-Cov (Cui et al. 2025,
"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv:2505.22617).

The paper shows entropy falls in proportion to the covariance between a token's
log-probability and its advantage, and restrains the few tokens with the highest
covariance.  Per valid token t of the call's batch (centring over its valid tokens):

    Cov_t = (A_t - mean(A)) * (log pi(y_t) - mean(log pi))

Clip-Cov detaches (here: zeroes the loss of) a random subset of
``max(1, int(clip_cov_ratio * N))`` tokens among those with
``clip_cov_lb < Cov_t < clip_cov_ub`` that the PPO clip has not already clipped;
KL-Cov adds ``ppo_kl_coef * |log pi - log pi_old|`` to the loss of the
``max(1, int(kl_cov_ratio * N))`` tokens of largest Cov_t (N = valid tokens).
The selection is made over the tokens passed in one call (a micro-batch), as in
the paper's code, so unlike the aggregation it depends on the micro-batch split.
Config keys (``actor.policy_loss.*``, verl names and defaults): clip_cov_ratio
0.0002, clip_cov_lb 1.0, clip_cov_ub 5.0, kl_cov_ratio 0.0002, ppo_kl_coef 0.1
(verl's ``PolicyLossConfig``).  Calling convention as in policy_losses/__init__.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms.aggregation import agg_loss
from rlhf.algorithms.config_access import config_get
from rlhf.algorithms.masked_ops import masked_mean
from rlhf.algorithms.policy_losses._inputs import agg_kwargs, apply_weights, as_metrics, clip_bounds, prepare
from rlhf.algorithms.policy_losses.ppo import LOG_RATIO_CLAMP
from rlhf.algorithms.registry import PolicyLossMode, register_policy_loss

Tensor = torch.Tensor


def token_covariance(advantages: Tensor, log_prob: Tensor, valid: Tensor) -> Tensor:
    """Cov_t = (A_t - mean A)(log pi_t - mean log pi) over the valid tokens (detached); -inf where masked."""
    advantages, log_prob = advantages.detach(), log_prob.detach()
    cov = (advantages - masked_mean(advantages, valid)) * (log_prob - masked_mean(log_prob, valid))
    return torch.where(valid, cov, torch.full_like(cov, -torch.inf))


def _ratio_arg(config: Any, key: str) -> float:
    value = config_get(config, f"policy_loss.{key}", 0.0002)
    if not value > 0:
        raise ValueError(f"actor.policy_loss.{key} must be > 0, got {value}")
    return value


@register_policy_loss(PolicyLossMode.CLIP_COV)
def compute_policy_loss_clip_cov(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                 loss_agg_mode: str = "token-mean", config: Any = None,
                                 rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """Clip-Cov: the PPO clipped surrogate max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    with the loss of the selected high-covariance tokens set to 0 (no gradient), see the
    module docstring.  ``actor/pg_clipfrac`` = fraction of valid tokens so removed.

    Raises:
        ValueError: shape mismatch, or clip_cov_ratio <= 0.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_bounds(config)
    ratio_arg = _ratio_arg(config, "clip_cov_ratio")
    lb, ub = config_get(config, "policy_loss.clip_cov_lb", 1.0), config_get(config, "policy_loss.clip_cov_ub", 5.0)
    ratio = torch.exp(torch.clamp(x.log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped, clipped = -x.advantages * ratio, -x.advantages * torch.clamp(ratio, 1 - low, 1 + high)
    cov = token_covariance(x.advantages, x.log_prob, x.valid)
    candidates = (x.valid & ~(clipped > unclipped) & (cov > lb) & (cov < ub)).flatten().nonzero().flatten()
    n_clip = max(int(ratio_arg * int(x.valid.sum())), 1)
    chosen = candidates[torch.randperm(candidates.numel(), device=candidates.device)[:n_clip]]
    keep = torch.ones(x.valid.numel(), dtype=log_prob.dtype, device=log_prob.device)
    keep[chosen] = 0.0
    keep = keep.view_as(log_prob)
    pg_losses = apply_weights(torch.maximum(unclipped, clipped) * keep, rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config))
    return loss, as_metrics(pg_clipfrac=masked_mean((keep == 0).to(ratio.dtype), x.valid),
                            ppo_kl=masked_mean(-x.log_ratio, x.valid))


@register_policy_loss(PolicyLossMode.KL_COV)
def compute_policy_loss_kl_cov(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                               loss_agg_mode: str = "token-mean", config: Any = None,
                               rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """KL-Cov: the unclipped surrogate -A r on every token, plus ``ppo_kl_coef * |log r|`` on
    the top-k covariance tokens (see the module docstring).  ``actor/ppo_kl`` is the masked
    mean of |log r| (verl's metric).

    Raises:
        ValueError: shape mismatch, or kl_cov_ratio <= 0.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    ratio_arg = _ratio_arg(config, "kl_cov_ratio")
    coef = config_get(config, "policy_loss.ppo_kl_coef", 0.1)
    ratio = torch.exp(torch.clamp(x.log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    abs_kl = x.log_ratio.abs()
    n_valid = int(x.valid.sum())
    penalised = torch.zeros(x.valid.numel(), dtype=torch.bool, device=log_prob.device)
    if n_valid:
        cov = token_covariance(x.advantages, x.log_prob, x.valid).flatten()
        penalised[torch.topk(cov, min(n_valid, max(1, int(n_valid * ratio_arg)))).indices] = True
    pg_losses = -x.advantages * ratio + torch.where(penalised.view_as(ratio), coef * abs_kl, torch.zeros_like(abs_kl))
    pg_losses = apply_weights(pg_losses, rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config))
    return loss, as_metrics(ppo_kl=masked_mean(abs_kl, x.valid))
