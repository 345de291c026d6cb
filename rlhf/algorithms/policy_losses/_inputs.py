"""Shared input handling of the registered policy losses (verl calling convention).

Every policy loss takes ``(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights)``; ``config`` is an actor config
(verl ``ActorConfig``, our ``actor`` DictConfig, a dict, or None for verl's
defaults) read through :func:`config_get`.
"""

from typing import Any, NamedTuple, Optional

import torch

from rlhf.algorithms._validation import check_2d, check_same_shape
from rlhf.algorithms.config_access import config_get


class PolicyInputs(NamedTuple):
    """Validated inputs with masked positions zeroed (NaN padding cannot leak).

    valid: bool (bs, L); advantages, log_ratio (= log_prob - old_log_prob), log_prob: (bs, L).
    """

    valid: torch.Tensor
    advantages: torch.Tensor
    log_ratio: torch.Tensor
    log_prob: torch.Tensor


#: a metric that is always 0 for a loss (e.g. no clip fraction), as verl reports it
ZERO = torch.tensor(0.0)


def prepare(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights=None) -> PolicyInputs:
    """Check shapes (2-D, all equal, weights too) and zero every masked entry.

    Raises:
        ValueError: naming the mismatching shapes.
    """
    check_2d("log_prob", log_prob)
    tensors = dict(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    if rollout_is_weights is not None:
        tensors["rollout_is_weights"] = rollout_is_weights
    check_same_shape(**tensors)
    valid = response_mask != 0
    zeros = torch.zeros_like(log_prob)
    return PolicyInputs(
        valid=valid,
        advantages=torch.where(valid, advantages, torch.zeros_like(advantages)),
        log_ratio=torch.where(valid, log_prob - old_log_prob, zeros),
        log_prob=torch.where(valid, log_prob, zeros),
    )


def clip_bounds(config: Any) -> tuple[float, float]:
    """(epsilon_low, epsilon_high): ``clip_ratio_low`` / ``clip_ratio_high``, each defaulting to
    ``clip_ratio`` (default 0.2, verl's)."""
    clip_ratio = config_get(config, "clip_ratio", 0.2)
    return config_get(config, "clip_ratio_low", clip_ratio), config_get(config, "clip_ratio_high", clip_ratio)


def agg_kwargs(config: Any) -> dict:
    """Keyword arguments for ``agg_loss`` from ``config.global_batch_info`` (dp_size,
    batch_num_tokens, global_batch_size[, loss_scale_factor]) and ``config.loss_scale_factor``."""
    info = dict(config_get(config, "global_batch_info", None) or {})
    info.setdefault("loss_scale_factor", config_get(config, "loss_scale_factor", None))
    return {k: info.get(k) for k in ("batch_num_tokens", "global_batch_size", "loss_scale_factor")} | {
        "dp_size": info.get("dp_size") or 1}


def apply_weights(pg_losses: torch.Tensor, rollout_is_weights: Optional[torch.Tensor],
                  valid: torch.Tensor) -> torch.Tensor:
    """Multiply by detached rollout importance weights (truncated IS / rollout correction), 0 where masked."""
    if rollout_is_weights is None:
        return pg_losses
    weights = torch.where(valid, rollout_is_weights.detach(), torch.zeros_like(rollout_is_weights))
    return pg_losses * weights


def as_metrics(**values: torch.Tensor) -> dict:
    """``{"actor/<name>": float}``, verl's metric names and python floats."""
    return {f"actor/{name}": float(value.detach()) for name, value in values.items()}
