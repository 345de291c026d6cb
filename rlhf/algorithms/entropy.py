"""Policy entropy from logits and its aggregated bonus (verl ``compute_entropy_loss``)."""

import torch

from rlhf.algorithms.aggregation import agg_loss


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
