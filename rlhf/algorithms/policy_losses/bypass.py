"""Rollout correction's bypass mode (``algorithm.rollout_correction.bypass_mode=true``, verl's
compute_policy_loss_bypass_mode and compute_policy_loss_reinforce in verl/trainer/ppo/core_algos.py): the trainer
skips the old-log-prob forward and trains against the engine's log-probs (old_log_prob = rollout_log_prob, two
policies instead of three).  The loss computes the rollout correction from the CURRENT log-probs against the
engine's (rlhf.algorithms.rollout_corr) and then

* ``loss_type=ppo_clip`` (default): the vanilla PPO clip with r = pi_theta / pi_rollout on the mask left by
  rejection sampling, no IS weights (the ratio already is the IS ratio);
* ``loss_type=reinforce``: l_t = -w_t A_t log pi_theta(y_t) with the truncated IS weights w (none when
  ``rollout_is`` is null).

The settings come from ``config.policy_loss.rollout_correction`` (verl's place; rlhf.workers.losses puts
``algorithm.rollout_correction`` there).  Metrics: the loss's and the ``rollout_corr/...`` ones.
"""

from typing import Any, Optional

import torch

from rlhf.algorithms.config_access import config_get
from rlhf.algorithms.policy_losses.policy_gradient import compute_policy_loss_gpg
from rlhf.algorithms.policy_losses.ppo import compute_policy_loss_vanilla
from rlhf.algorithms.registry import PolicyLossMode, register_policy_loss
from rlhf.algorithms.rollout_corr_config import BYPASS_LOSS_TYPES

Tensor = torch.Tensor


def compute_policy_loss_reinforce(rollout_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
                                  response_mask: Tensor, loss_agg_mode: str = "seq-mean-token-sum", config: Any = None,
                                  rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """REINFORCE with optional IS weights (verl's compute_policy_loss_reinforce; not in the registry there either):

        l_t = -A_t * log pi_theta(y_t) * sg(w_t)      (w_t = 1 without weights)

    aggregated by ``loss_agg_mode``; ``actor/ppo_kl`` = masked mean of log pi_rollout - log pi_theta.
    All tensors [B, R].  Raises ValueError on a shape mismatch."""
    return compute_policy_loss_gpg(rollout_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                   rollout_is_weights)  # the same loss as GPG's, with verl's default aggregation


@register_policy_loss(PolicyLossMode.BYPASS_MODE)
def compute_policy_loss_bypass_mode(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                    loss_agg_mode: str = "token-mean", config: Any = None,
                                    rollout_is_weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """Bypass-mode policy loss (module docstring); `old_log_prob` IS the engine's log-probs [B, R] here and
    `rollout_is_weights` is ignored (computed inside from the current log-probs, without gradient).

    Raises ValueError without ``config.policy_loss.rollout_correction`` or for another ``loss_type``."""
    from rlhf.algorithms.rollout_corr import (
        compute_rollout_correction_and_rejection_mask,
    )

    rc = config_get(config, "policy_loss.rollout_correction")
    if rc is None:
        raise ValueError("rollout_correction config not found in policy_loss. When using loss_mode='bypass_mode', "
                         "ensure rollout_correction config is passed.")
    loss_type = config_get(rc, "loss_type", "ppo_clip")
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    if not response_mask.any():  # a micro batch without loss tokens: nothing to correct (verl would raise)
        return compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)
    with torch.no_grad():
        weights, mask, corr_metrics = compute_rollout_correction_and_rejection_mask(
            log_prob, old_log_prob, response_mask, rollout_is=config_get(rc, "rollout_is"),
            rollout_is_threshold=config_get(rc, "rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=bool(config_get(rc, "rollout_is_batch_normalize", False)),
            rollout_rs=config_get(rc, "rollout_rs"), rollout_rs_threshold=config_get(rc, "rollout_rs_threshold"))
    if loss_type == "reinforce":
        loss, metrics = compute_policy_loss_reinforce(old_log_prob, log_prob, advantages, mask, loss_agg_mode, config,
                                                      rollout_is_weights=weights)
    else:
        loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, loss_agg_mode, config,
                                                    rollout_is_weights=None)
    metrics.update(corr_metrics)
    return loss, metrics
