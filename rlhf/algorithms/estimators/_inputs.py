"""Input checks and helpers shared by the advantage estimators (token-level and group-relative).

``sample_mask`` (bs,) marks the samples whose reward is trustworthy (1) and the
ones the reward could not score (0: error, timeout, None, non-finite).  Invalid
samples are left out of every group baseline and get advantage 0; the trainer
also drops them from the loss (``response_mask * sample_mask[:, None]``).
"""

from typing import Optional

import torch

from rlhf.algorithms._validation import check_2d, check_same_shape
from rlhf.algorithms.grouping import GroupStats, group_ids, group_stats
from rlhf.algorithms.masked_ops import masked_sum


def check_rewards_and_mask(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Raise ValueError unless both are 2-D (bs, response_length) of the same shape."""
    check_2d("token_level_rewards", token_level_rewards)
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)


def sample_validity(sample_mask: Optional[torch.Tensor], batch_size: int, device: torch.device) -> torch.Tensor:
    """Bool (bs,) validity from an optional 0/1 or bool ``sample_mask`` (None: all valid).

    Raises:
        ValueError: ``sample_mask`` is not of shape (bs,).
    """
    if sample_mask is None:
        return torch.ones(batch_size, dtype=torch.bool, device=device)
    sample_mask = torch.as_tensor(sample_mask, device=device)
    if tuple(sample_mask.shape) != (batch_size,):
        raise ValueError(f"sample_mask must have shape ({batch_size},), got {tuple(sample_mask.shape)}")
    return sample_mask != 0


def refuse_non_finite(name: str, values: torch.Tensor, valid: torch.Tensor) -> None:
    """Raise ValueError naming the first samples where ``values`` is non-finite and ``valid``.

    One inf or NaN reward would turn a whole group's (or, through whitening, the whole
    batch's) advantages into NaN, so it is refused before any arithmetic.
    """
    bad = valid & ~torch.isfinite(values)
    if bool(bad.any()):
        rows = bad.reshape(bad.shape[0], -1).any(dim=-1).nonzero().flatten().tolist()
        shown = ", ".join(f"sample {r}" for r in rows[:5]) + (" ..." if len(rows) > 5 else "")
        raise ValueError(
            f"{name} is non-finite (inf/NaN) in {len(rows)} valid sample(s): {shown}; mark unscorable samples "
            "invalid with sample_mask=0 (the reward manager counts them in reward/num_fallbacks) or fix the reward"
        )


def outcome_scores(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, sample_mask: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample outcome score ``R_i = sum_t mask_t * r_t`` and validity.

    Returns:
        (scores, valid): scores (bs,) with 0 at invalid samples; valid bool (bs,).

    Raises:
        ValueError: shape errors, or a non-finite score at a valid sample.
    """
    check_rewards_and_mask(token_level_rewards, response_mask)
    valid = sample_validity(sample_mask, token_level_rewards.shape[0], token_level_rewards.device)
    scores = masked_sum(token_level_rewards, response_mask, axis=-1)
    refuse_non_finite("token_level_rewards (sequence score)", scores, valid)
    return torch.where(valid, scores, torch.zeros_like(scores)), valid


def effective_mask(response_mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``response_mask`` with the rows of invalid samples zeroed (same dtype and shape)."""
    return torch.where(valid.unsqueeze(-1), response_mask, torch.zeros_like(response_mask))


def broadcast_over_response(scalars: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(bs,) scalar per response -> (bs, response_length), 0 at masked positions."""
    per_token = scalars.unsqueeze(-1).expand(response_mask.shape)
    return torch.where(response_mask != 0, per_token, torch.zeros_like(per_token))


def token_inputs(token_level_rewards, response_mask, sample_mask, **more: torch.Tensor):
    """Validate, apply ``sample_mask`` to the mask and refuse non-finite valid entries."""
    check_rewards_and_mask(token_level_rewards, response_mask)
    valid = sample_validity(sample_mask, token_level_rewards.shape[0], token_level_rewards.device)
    mask = effective_mask(response_mask, valid)
    for name, tensor in {"token_level_rewards": token_level_rewards, **more}.items():
        refuse_non_finite(name, tensor, mask != 0)
    return mask


def grouped(token_level_rewards, response_mask, index, sample_mask):
    """Scores, validity, dense group ids, total group sizes and :class:`GroupStats` over valid samples."""
    scores, valid = outcome_scores(token_level_rewards, response_mask, sample_mask)
    gid, n_groups = group_ids(index, scores.shape[0], scores.device)
    total = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add(
        0, gid, torch.ones_like(scores))
    return scores, valid, gid, total[gid], group_stats(scores, gid, n_groups, valid)


def centered_scores(scores, valid, gid, total, stats: GroupStats) -> torch.Tensor:
    """``R_i - mean_g`` with exact 0 for constant groups and invalid samples, ``R_i`` for groups of size 1."""
    centered = torch.where(stats.constant[gid], torch.zeros_like(scores), scores - stats.mean[gid])
    centered = torch.where(total < 2, scores, centered)
    return torch.where(valid, centered, torch.zeros_like(scores))
