"""Group bookkeeping for group-relative estimators (GRPO, RLOO, DAPO filter).

``index`` holds one prompt uid per sample (numpy array, list or tensor of
hashable ids); samples that share a uid were generated from the same prompt.
"""

from collections.abc import Sequence
from typing import Union

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


def group_count_mean_std(scores: torch.Tensor, gid: torch.Tensor, n_groups: int):
    """Per-group size, mean and unbiased std (0 for groups of size 1) of ``scores``.

    Args:
        scores: shape (bs,); gid: shape (bs,) from :func:`group_ids`.

    Returns:
        (count, mean, std), each of shape (n_groups,), dtype of ``scores``.
    """
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, gid, torch.ones_like(scores))
    mean = zeros.index_add(0, gid, scores) / count
    squared_dev = zeros.index_add(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(squared_dev / (count - 1).clamp_min(1))
    return count, mean, std
