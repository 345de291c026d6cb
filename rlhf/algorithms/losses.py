"""Loss aggregation and the PPO actor / critic / entropy losses.

All loss matrices have shape (bs, response_length).  Masked-out positions
are dropped with ``torch.where``, so any padding value (NaN, inf, huge)
leaves every returned value unchanged.
"""

from typing import Optional

import torch

from rlhf.algorithms._validation import check_2d, check_same_shape
from rlhf.algorithms.masked_ops import masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Clamp on log(pi/pi_old) before exp() (verl value): keeps the ratio finite.
_LOG_RATIO_CLAMP = 20.0


def _seq_mean(seq_losses: torch.Tensor, seq_has_tokens: torch.Tensor) -> torch.Tensor:
    """Mean over the sequences that have at least one valid token (0 if none)."""
    kept = torch.where(seq_has_tokens, seq_losses, torch.zeros_like(seq_losses))
    n_seqs = seq_has_tokens.sum().clamp_min(1)
    return kept.sum() / n_seqs


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    loss_scale_factor: Optional[float] = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar.

    Modes (m = loss_mask, L = loss_mat, i = sequence, t = token):

    * ``"token-mean"``: sum_it m L / sum_it m  (DAPO, Yu et al. 2025, eq. 12).
    * ``"seq-mean-token-sum"``: mean_i sum_t m L.
    * ``"seq-mean-token-mean"``: mean_i (sum_t m L / sum_t m)  (GRPO, Shao et al. 2024, eq. 3).
    * ``"seq-mean-token-sum-norm"``: sum_it m L / loss_scale_factor, a constant
      normaliser defaulting to ``loss_mat.shape[-1]`` (Dr.GRPO, Liu et al. 2025,
      arXiv:2503.20783).  Like verl, it is *not* divided by the batch size.

    Sequence means are taken over sequences with at least one valid token
    (as in current verl); a batch with no valid token returns 0 in every mode.

    Args:
        loss_mat: per-token loss, shape (bs, response_length).
        loss_mask: 1 for tokens that count, same shape.
        loss_agg_mode: one of LOSS_AGG_MODES.
        loss_scale_factor: normaliser for "seq-mean-token-sum-norm" only.

    Returns:
        Scalar loss tensor (differentiable w.r.t. ``loss_mat``).

    Raises:
        ValueError: shape mismatch, non-2D input, unknown mode, or
            ``loss_scale_factor <= 0``.
    """
    check_2d("loss_mat", loss_mat)
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    valid = loss_mask != 0
    masked = torch.where(valid, loss_mat * loss_mask, torch.zeros_like(loss_mat))
    tokens_per_seq = loss_mask.to(loss_mat.dtype).sum(dim=-1)

    if loss_agg_mode == "token-mean":
        return masked.sum() / tokens_per_seq.sum().clamp_min(1)
    if loss_agg_mode == "seq-mean-token-sum":
        return _seq_mean(masked.sum(dim=-1), tokens_per_seq > 0)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked.sum(dim=-1) / tokens_per_seq.clamp_min(1)
        return _seq_mean(seq_losses, tokens_per_seq > 0)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            loss_scale_factor = loss_mat.shape[-1]
        if loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
        return masked.sum() / loss_scale_factor
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {list(LOSS_AGG_MODES)}")


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
    """Clipped PPO surrogate with dual-clip and decoupled clip ranges.

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
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    if cliprange_low is None or cliprange_high is None:
        raise ValueError("compute_policy_loss needs cliprange, or both cliprange_low and cliprange_high")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")

    # Zero padded entries first, so NaN padding cannot reach values or gradients.
    valid = response_mask != 0
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
    log_ratio = torch.where(valid, log_prob - old_log_prob, torch.zeros_like(log_prob))
    log_ratio = torch.clamp(log_ratio, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    ppo_loss = torch.maximum(unclipped_loss, clipped_loss)
    pg_clipfrac = masked_mean((clipped_loss > unclipped_loss).to(ratio.dtype), response_mask)

    dual_clip_loss = -advantages * clip_ratio_c
    negative_adv = advantages < 0
    pg_clipfrac_lower = masked_mean(((ppo_loss > dual_clip_loss) & negative_adv).to(ratio.dtype), response_mask)
    pg_losses = torch.where(negative_adv, torch.minimum(ppo_loss, dual_clip_loss), ppo_loss)

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2 baselines / verl):

        v_clip = clip(vpreds, values - cliprange_value, values + cliprange_value)
        loss   = 0.5 * agg(max((vpreds - returns)^2, (v_clip - returns)^2))

    Args:
        vpreds: current critic predictions, shape (bs, response_length).
        returns: return targets (e.g. from GAE), same shape.
        values: critic predictions at rollout time, same shape.
        response_mask: 1 for response tokens, same shape.
        cliprange_value: clip half-width, in reward units.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        vf_loss: scalar loss.
        vf_clipfrac: fraction of valid tokens where the clipped error was larger.

    Raises:
        ValueError: shape mismatch or unknown ``loss_agg_mode``.
    """
    check_2d("vpreds", vpreds)
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    # Zero padded entries first, so NaN padding cannot reach values or gradients.
    valid = response_mask != 0
    vpreds, returns, values = (torch.where(valid, x, torch.zeros_like(x)) for x in (vpreds, returns, values))
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_error = (vpreds - returns) ** 2
    clipped_error = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(unclipped_error, clipped_error), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean((clipped_error > unclipped_error).to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregate per-token policy entropy (nats) into a scalar.

    The result is the entropy itself (positive); the trainer subtracts
    ``entropy_coeff * entropy_loss`` from the policy loss to encourage
    exploration (Mnih et al. 2016; Schulman et al. 2017, eq. 9).

    Args:
        entropy: per-token entropy, shape (bs, response_length).
        response_mask: 1 for response tokens, same shape.
        loss_agg_mode: see :func:`agg_loss`.

    Raises:
        ValueError: shape mismatch or unknown ``loss_agg_mode``.
    """
    return agg_loss(entropy, response_mask, loss_agg_mode)
