"""Loss aggregation: a per-token loss matrix to a scalar (verl ``agg_loss``), split-invariant.

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
from rlhf.algorithms.registry import LOSS_AGG_MODES

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
