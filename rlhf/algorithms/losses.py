"""Loss aggregation and the PPO actor / critic / entropy losses.

All loss matrices have shape (bs, response_length).  Masked-out positions
are dropped with ``torch.where``, so any padding value (NaN, inf, huge)
leaves every returned value unchanged.

Micro-batch / data-parallel invariance.  Every aggregation mode is a sum over
tokens or sequences divided by a count.  Given the counts of the whole
mini-batch (``batch_num_tokens``, ``global_batch_size``: see
:func:`global_batch_info`) and ``dp_size``, ``agg_loss`` on one micro-batch
returns ``local_sum / global_count * dp_size``.  Summing these over the
micro-batches of a rank and averaging over the ``dp_size`` ranks (what
data-parallel gradient averaging does) gives exactly the loss and gradient of
the whole mini-batch in one piece, however it was split.  Megatron's pipeline
schedule divides each micro-batch loss by the number of micro-batches, so a
Megatron ``loss_fn`` multiplies the result by that number.
"""

from typing import Optional, Union

import torch

from rlhf.algorithms._validation import check_2d, check_same_shape
from rlhf.algorithms.masked_ops import masked_mean

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Clamp on log(pi/pi_old) before exp() (verl value): keeps the ratio finite.
LOG_RATIO_CLAMP = 20.0

Count = Union[int, float, torch.Tensor, None]


def global_batch_info(response_mask: torch.Tensor, dp_size: int = 1) -> dict:
    """Counts of a whole mini-batch that make :func:`agg_loss` split-invariant.

    Call it on the mini-batch's loss mask BEFORE it is split into data-parallel
    shards and micro-batches (every rank holds the full mini-batch in our
    trainer, so no all-reduce is needed), and pass the dict to ``agg_loss`` /
    as ``config.global_batch_info`` of a policy loss.

    Args:
        response_mask: loss mask of the whole mini-batch, shape (bs, response_length).
        dp_size: number of data-parallel ranks whose gradients are averaged.

    Returns:
        ``{"dp_size": int, "batch_num_tokens": int, "global_batch_size": int}``: valid
        tokens, and sequences with at least one valid token.

    Raises:
        ValueError: non-2D mask or ``dp_size < 1``.
    """
    check_2d("response_mask", response_mask)
    if int(dp_size) < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    valid = response_mask != 0
    return {"dp_size": int(dp_size), "batch_num_tokens": int(valid.sum()),
            "global_batch_size": int(valid.any(dim=-1).sum())}


def _normaliser(count: Count, local: torch.Tensor) -> torch.Tensor:
    """The global count when given, else the local one; never below 1 (empty -> loss 0)."""
    total = local if count is None else torch.as_tensor(count, dtype=local.dtype, device=local.device)
    return total.clamp_min(1)


def aggregate_sequences(seq_losses: torch.Tensor, seq_mask: torch.Tensor, dp_size: int = 1,
                        global_batch_size: Count = None) -> torch.Tensor:
    """Mean over sequences: ``sum_i seq_mask_i * seq_losses_i / global_batch_size * dp_size``.

    Args:
        seq_losses: per-sequence loss, shape (bs,).
        seq_mask: bool (bs,), True for sequences that count (at least one valid token).
        dp_size, global_batch_size: see :func:`agg_loss`; None counts ``seq_mask`` locally.
    """
    kept = torch.where(seq_mask, seq_losses, torch.zeros_like(seq_losses))
    return kept.sum() / _normaliser(global_batch_size, seq_mask.to(seq_losses.dtype).sum()) * dp_size


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Count = None,
    global_batch_size: Count = None,
    loss_scale_factor: Optional[float] = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar (verl's signature).

    Modes (m = loss_mask, L = loss_mat, i = sequence, t = token; N_tok / N_seq =
    ``batch_num_tokens`` / ``global_batch_size``, local counts when None; every
    mode is then multiplied by ``dp_size``):

    * ``"token-mean"``: sum_it m L / N_tok  (DAPO, Yu et al. 2025, arXiv:2503.14476, eq. 12).
    * ``"token-sum"``: sum_it m L, no normaliser (verl's mode: the step's gradient is the sum over every
      valid token of the mini-batch, so its scale follows the number of tokens).
    * ``"seq-mean-token-sum"``: sum_i (sum_t m L) / N_seq.
    * ``"seq-mean-token-mean"``: sum_i (sum_t m L / sum_t m) / N_seq  (GRPO, Shao et al. 2024, eq. 3).
    * ``"seq-mean-token-sum-norm"``: sum_i (sum_t m L / C) / N_seq with a constant C =
      ``loss_scale_factor`` (default ``loss_mat.shape[-1]``): Dr.GRPO (Liu et al. 2025,
      arXiv:2503.20783, eq. 3) replaces GRPO's 1/|o_i| by a constant but keeps 1/G.
      (verl omits the 1/N_seq, so its loss grows with the number of sequences in a
      micro-batch; verl's newer versions divide by it too.)

    N_seq counts sequences with at least one valid token; a batch with no valid
    token returns 0 in every mode.  See the module docstring for how the global
    counts make the result invariant to micro-batching and data parallelism.

    Args:
        loss_mat: per-token loss, shape (bs, response_length).
        loss_mask: 1 for tokens that count, same shape.
        loss_agg_mode: one of LOSS_AGG_MODES.
        dp_size: data-parallel ranks whose gradients are averaged (>= 1).
        batch_num_tokens: valid tokens in the whole mini-batch (all micro-batches, all ranks).
        global_batch_size: sequences with a valid token in the whole mini-batch.
        loss_scale_factor: C of "seq-mean-token-sum-norm" only.

    Returns:
        Scalar loss tensor (differentiable w.r.t. ``loss_mat``).

    Raises:
        ValueError: shape mismatch, non-2D input, unknown mode, ``dp_size < 1``
            or ``loss_scale_factor <= 0``.
    """
    check_2d("loss_mat", loss_mat)
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {list(LOSS_AGG_MODES)}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    valid = loss_mask != 0
    masked = torch.where(valid, loss_mat * loss_mask, torch.zeros_like(loss_mat))
    tokens_per_seq = torch.where(valid, loss_mask, torch.zeros_like(loss_mask)).to(loss_mat.dtype).sum(dim=-1)
    has_tokens = tokens_per_seq > 0

    if loss_agg_mode == "token-mean":
        return masked.sum() / _normaliser(batch_num_tokens, tokens_per_seq.sum()) * dp_size
    if loss_agg_mode == "token-sum":
        return masked.sum() * dp_size
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = masked.sum(dim=-1)
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked.sum(dim=-1) / tokens_per_seq.clamp_min(1)
    else:
        if loss_scale_factor is None:
            loss_scale_factor = loss_mat.shape[-1]
        if loss_scale_factor <= 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
        seq_losses = masked.sum(dim=-1) / loss_scale_factor
    return aggregate_sequences(seq_losses, has_tokens, dp_size, global_batch_size)


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


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **global_info,
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
        **global_info: ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size`` /
            ``loss_scale_factor`` forwarded to :func:`agg_loss`.

    Returns:
        vf_loss: scalar loss.
        vf_clipfrac: fraction of valid tokens where the clipped error was larger.

    Raises:
        ValueError: shape mismatch or unknown ``loss_agg_mode``.
    """
    check_2d("vpreds", vpreds)
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    valid = response_mask != 0
    vpreds, returns, values = (torch.where(valid, x, torch.zeros_like(x)) for x in (vpreds, returns, values))
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_error = (vpreds - returns) ** 2
    clipped_error = (vpred_clipped - returns) ** 2
    errors = torch.maximum(unclipped_error, clipped_error)
    vf_loss = 0.5 * agg_loss(errors, response_mask, loss_agg_mode, **global_info)
    vf_clipfrac = masked_mean((clipped_error > unclipped_error).to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy H = logsumexp(z) - sum_v softmax(z)_v z_v in nats, over the last axis.

    Args:
        logits: shape (..., vocab_size).

    Returns:
        Shape (...), differentiable.
    """
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", **global_info
) -> torch.Tensor:
    """Aggregated policy entropy (nats) from logits, verl's signature.

    The result is the entropy itself (positive); the trainer subtracts
    ``entropy_coeff * entropy_loss`` from the policy loss to encourage
    exploration (Mnih et al. 2016; Schulman et al. 2017, eq. 9).  When the
    per-token entropy is already computed, call ``agg_loss(entropy, mask, mode)``.

    Args:
        logits: shape (bs, response_length, vocab_size).
        response_mask: 1 for response tokens, shape (bs, response_length).
        loss_agg_mode: see :func:`agg_loss`.
        **global_info: forwarded to :func:`agg_loss`.

    Raises:
        ValueError: logits not 3-D, shape mismatch or unknown ``loss_agg_mode``.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (bs, response_length, vocab_size), got {tuple(logits.shape)}; "
                         "for a per-token entropy use agg_loss(entropy, response_mask, loss_agg_mode)")
    valid = (response_mask != 0).unsqueeze(-1)
    entropy = entropy_from_logits(torch.where(valid, logits, torch.zeros_like(logits)))
    return agg_loss(entropy, response_mask, loss_agg_mode, **global_info)
