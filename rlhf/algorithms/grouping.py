"""Group bookkeeping for group-relative estimators (GRPO, RLOO, DAPO filter).

``index`` holds one prompt uid per sample (numpy array, list or tensor of
hashable ids); samples that share a uid were generated from the same prompt.
"""

from collections.abc import Sequence
from typing import NamedTuple, Union

import numpy as np
import torch

GroupIndex = Union[np.ndarray, Sequence, torch.Tensor]


def group_ids(index: GroupIndex, batch_size: int, device: torch.device = None) -> tuple[torch.Tensor, int]:
    """Map prompt uids to dense group ids 0..n_groups-1 in first-seen order.

    Returns:
        (gid, n_groups): gid is a LongTensor of shape (batch_size,).

    Raises:
        ValueError: ``len(index) != batch_size``.
    """
    uids = index.tolist() if isinstance(index, (np.ndarray, torch.Tensor)) else list(index)
    if len(uids) != batch_size:
        raise ValueError(f"index has {len(uids)} entries but the batch has {batch_size} samples")
    dense: dict = {}
    gid = [dense.setdefault(uid, len(dense)) for uid in uids]
    return torch.tensor(gid, dtype=torch.long, device=device), len(dense)


class GroupStats(NamedTuple):
    """Per-group statistics over the VALID samples, each of shape (n_groups,).

    count: number of valid samples; mean, std: their mean and unbiased std (std 0 when
    count < 2); constant: True when all valid scores are exactly equal (max == min) or the
    group has no valid sample.  ``constant`` lets estimators return an exact 0 instead of a
    rounding residue ``score - mean`` (e.g. three rewards of 0.3 have a mean 1 ulp off 0.3).
    """

    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    constant: torch.Tensor


def group_stats(scores: torch.Tensor, gid: torch.Tensor, n_groups: int, valid: torch.Tensor) -> GroupStats:
    """Statistics of ``scores`` per group over the samples where ``valid`` is True.

    Args:
        scores: shape (bs,), finite wherever ``valid`` (other entries are ignored).
        gid: shape (bs,) from :func:`group_ids`.
        n_groups: number of groups.
        valid: bool, shape (bs,).
    """
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    kept = torch.where(valid, scores, torch.zeros_like(scores))
    count = zeros.index_add(0, gid, valid.to(scores.dtype))
    mean = zeros.index_add(0, gid, kept) / count.clamp_min(1)
    deviation = torch.where(valid, scores - mean[gid], torch.zeros_like(scores))
    std = torch.sqrt(zeros.index_add(0, gid, deviation**2) / (count - 1).clamp_min(1))
    high = torch.full_like(zeros, -torch.inf).scatter_reduce(
        0, gid, torch.where(valid, scores, torch.full_like(scores, -torch.inf)), reduce="amax")
    low = torch.full_like(zeros, torch.inf).scatter_reduce(
        0, gid, torch.where(valid, scores, torch.full_like(scores, torch.inf)), reduce="amin")
    constant = (high == low) | (count == 0)
    std = torch.where(constant, torch.zeros_like(std), std)
    return GroupStats(count, mean, std, constant)
