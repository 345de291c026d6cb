"""PPO-style ratio surrogates: the clipped objective with dual clip and decoupled ranges
(``vanilla``, and verl's older 4-tuple ``compute_policy_loss``) and SAPO's soft gate.

The per-token ratio r = exp(log pi - log pi_old) has its log clamped to [-20, 20] (verl's
value) so it stays finite.  Calling convention, config fields and metrics: policy_losses/__init__.py.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms._validation import check_2d, check_same_shape
from rlhf.algorithms.aggregation import agg_loss
from rlhf.algorithms.config_access import config_get
from rlhf.algorithms.masked_ops import masked_mean
from rlhf.algorithms.policy_losses._inputs import ZERO, agg_kwargs, apply_weights, as_metrics, clip_bounds, prepare
from rlhf.algorithms.registry import PolicyLossMode, register_policy_loss

Tensor = torch.Tensor

# Clamp on log(pi/pi_old) before exp() (verl value): keeps the ratio finite.
LOG_RATIO_CLAMP = 20.0


def ppo_clip_losses(log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor, cliprange_low: float,
                    cliprange_high: float, clip_ratio_c: float):
    """Per-token clipped PPO loss with dual clip; see :func:`compute_policy_loss` for the formula.

    Args:
        log_ratio: log pi - log pi_old, 0 at masked positions, shape (bs, response_length).
        advantages: same shape, 0 at masked positions.
        valid: bool mask, same shape.

    Returns:
        (pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower): the (bs, response_length)
        loss matrix and three scalar tensors (fractions over valid tokens; k1 KL).
    """
    log_ratio = torch.clamp(log_ratio, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, valid)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    ppo_loss = torch.maximum(unclipped_loss, clipped_loss)
    pg_clipfrac = masked_mean((clipped_loss > unclipped_loss).to(ratio.dtype), valid)
    dual_clip_loss = -advantages * clip_ratio_c
    negative_adv = advantages < 0
    pg_clipfrac_lower = masked_mean(((ppo_loss > dual_clip_loss) & negative_adv).to(ratio.dtype), valid)
    pg_losses = torch.where(negative_adv, torch.minimum(ppo_loss, dual_clip_loss), ppo_loss)
    return pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: Optional[float] = None,
    cliprange_low: Optional[float] = None,
    cliprange_high: Optional[float] = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped PPO surrogate with dual-clip and decoupled clip ranges (verl's older 4-tuple API;
    the registry's ``vanilla`` loss computes the same with verl's newer calling convention).

    Per token, with ratio r = exp(log_prob - old_log_prob) (log-ratio clamped to
    [-20, 20]) and advantage A:

        clipped = max(-A * r, -A * clip(r, 1 - cliprange_low, 1 + cliprange_high))
        loss    = clipped                        if A >= 0
                  min(clipped, -A * clip_ratio_c) if A < 0

    i.e. the negated clipped objective of Schulman et al. 2017 (PPO, eq. 7),
    dual-clip of Ye et al. 2020 ("Mastering Complex Control in MOBA Games",
    arXiv:1912.09729, eq. 5) bounding the loss for A < 0 and huge r, and the
    decoupled ("clip-higher") ranges of DAPO (Yu et al. 2025, eq. 10).

    Args:
        old_log_prob: log-probs under the rollout policy, nats, shape (bs, response_length).
        log_prob: log-probs under the current policy, same shape.
        advantages: per-token advantages, same shape.
        response_mask: 1 for response tokens, same shape.
        cliprange: symmetric epsilon, used where the low/high value is None.
        cliprange_low / cliprange_high: DAPO's epsilon_low / epsilon_high.
        clip_ratio_c: dual-clip constant c (> 1).
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        pg_loss: scalar loss.
        pg_clipfrac: fraction of valid tokens where the clipped term was active.
        ppo_kl: masked mean of (old_log_prob - log_prob), a k1 estimate of KL(old || new).
        pg_clipfrac_lower: fraction of valid tokens where the dual clip was active.

    Raises:
        ValueError: shape mismatch, no clip range given, or ``clip_ratio_c <= 1``.
    """
    check_2d("log_prob", log_prob)
    check_same_shape(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask
    )
    cliprange_low = cliprange if cliprange_low is None else cliprange_low
    cliprange_high = cliprange if cliprange_high is None else cliprange_high
    if cliprange_low is None or cliprange_high is None:
        raise ValueError("compute_policy_loss needs cliprange, or both cliprange_low and cliprange_high")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")
    valid = response_mask != 0
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
    log_ratio = torch.where(valid, log_prob - old_log_prob, torch.zeros_like(log_prob))
    pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower = ppo_clip_losses(
        log_ratio, advantages, valid, cliprange_low, cliprange_high, clip_ratio_c)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@register_policy_loss(PolicyLossMode.VANILLA)
def compute_policy_loss_vanilla(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """PPO clipped surrogate with dual clip and decoupled ranges (Schulman et al. 2017,
    arXiv:1707.06347, eq. 7; Ye et al. 2020, arXiv:1912.09729, eq. 5; DAPO eq. 10):

        r = exp(clamp(log pi - log pi_old, -20, 20))
        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high));   l = min(l, -A c) where A < 0

    aggregated by ``loss_agg_mode``.  Same numbers as ``compute_policy_loss``.

    Raises:
        ValueError: shape mismatch or ``clip_ratio_c <= 1``.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    low, high = clip_bounds(config)
    clip_ratio_c = config_get(config, "clip_ratio_c", 3.0)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")
    pg_losses, clipfrac, ppo_kl, clipfrac_lower = ppo_clip_losses(x.log_ratio, x.advantages, x.valid, low, high,
                                                                  clip_ratio_c)
    pg_losses = apply_weights(pg_losses, rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs(config))
    return loss, as_metrics(pg_clipfrac=clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=clipfrac_lower)


@register_policy_loss(PolicyLossMode.SAPO)
def compute_policy_loss_sapo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                             loss_agg_mode: str = "seq-mean-token-mean", config: Any = None,
                             rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """SAPO, Soft Adaptive Policy Optimization (Qwen team 2025, arXiv:2511.20347):
    a smooth sigmoid gate replaces the hard clip,

        f(r) = sigmoid(tau * (r - 1)) * 4 / tau,   tau = tau_pos if A > 0 else tau_neg
        l_t  = -f(r_t) * A_t

    so df/dr = 4 sigmoid (1 - sigmoid): 1 on-policy (r = 1, like the PG gradient),
    decaying smoothly as r leaves 1.  ``config.tau_pos`` / ``config.tau_neg``
    (defaults 1.0 / 1.05, verl's).  Aggregated ALWAYS as "seq-mean-token-mean" (as verl).

    Raises:
        ValueError: shape mismatch or a non-positive tau.
    """
    x = prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    tau_pos, tau_neg = config_get(config, "tau_pos", 1.0), config_get(config, "tau_neg", 1.05)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO needs tau_pos, tau_neg > 0, got {tau_pos}, {tau_neg}")
    ratio = torch.exp(torch.clamp(x.log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    tau = torch.where(x.advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    pg_losses = apply_weights(-gates * x.advantages, rollout_is_weights, x.valid)
    loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **agg_kwargs(config))
    return loss, as_metrics(pg_clipfrac=ZERO, ppo_kl=masked_mean(-x.log_ratio, x.valid), pg_clipfrac_lower=ZERO)
